"""Train the toy target: a tiny Qwen3ForCausalLM over the byte tokenizer, on stdlib code.

    python tools/train_toy_target.py --out dflash_callbacks/demos/toy/assets/target

writes a transformers model folder (config.json, generation_config.json,
model.safetensors, tokenizer files, chat template) plus train_log.json, loadable with
AutoModelForCausalLM / AutoTokenizer like any target. Seeds and the thread count are
fixed: on the same Python (same stdlib sources) and torch a rerun reproduces the weights
bit for bit. The shipped folder was made with the defaults below, in 162 s of training
(about 3 minutes with imports and data preparation) on 2 shared CPU cores.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from dflash_callbacks.demos.toy.corpus import module_texts, read_source, stdlib_sources
from dflash_callbacks.demos.toy.threads import torch_threads
from dflash_callbacks.demos.toy.tokenizer import ENDOFTEXT_ID, IM_END_ID, VOCAB_SIZE, build_byte_tokenizer

HIDDEN_SIZE = 128
NUM_LAYERS = 4
WINDOW = 64  # attention window, and the length of the training windows


def toy_target_config() -> Qwen3Config:
    """4 layers of hidden size 128, each with sliding-window attention over the last WINDOW
    tokens, the length of its training windows: a model this small falls apart when it
    attends further back than it ever did in training, and the coding prompts through the
    chat template are 300-400 bytes long. (The window is also why its answers depend on
    the end of a request only: this is a toy.)"""
    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=256,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        layer_types=["sliding_attention"] * NUM_LAYERS,
        sliding_window=WINDOW,
        use_sliding_window=True,
        max_window_layers=0,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
    )


def training_streams(tokenizer, max_bytes: int, seed: int) -> list[torch.Tensor]:
    """[code stream, chat stream]: 1-D token tensors from training-split stdlib files, taken
    in a seeded shuffled order until `max_bytes` of source has been read."""
    files = stdlib_sources("train")
    random.Random(seed).shuffle(files)
    code_ids: list[int] = []
    chat_ids: list[int] = []
    read = 0
    for path in files:
        source = read_source(path)
        code, examples = module_texts(source)
        if code:
            code_ids += tokenizer(code).input_ids + [ENDOFTEXT_ID]
        for request, answer in examples:
            turns = [{"role": "user", "content": request}, {"role": "assistant", "content": answer}]
            chat_ids += tokenizer(tokenizer.apply_chat_template(turns, tokenize=False), add_special_tokens=False).input_ids
        read += len(source)
        if read >= max_bytes:
            break
    return [torch.tensor(code_ids), torch.tensor(chat_ids)]


def sample_batch(streams: list[torch.Tensor], batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """[batch_size, seq_len + 1] windows at random offsets, alternating between the streams."""
    rows = []
    for i in range(batch_size):
        stream = streams[i % len(streams)]
        start = int(torch.randint(0, len(stream) - seq_len - 1, (1,), generator=gen))
        rows.append(stream[start : start + seq_len + 1])
    return torch.stack(rows)


def train_toy_target(
    out: str | Path,
    *,
    steps: int = 900,
    batch_size: int = 16,
    seq_len: int = WINDOW,
    lr: float = 4e-3,
    max_bytes: int = 2_000_000,
    seed: int = 0,
    threads: int = 1,
    progress: bool = True,
) -> dict:
    """Train from scratch and save the folder `out`; returns the log written to train_log.json
    (losses per step, wall seconds, corpus sizes). `threads`: torch threads while training;
    one is fastest for a model this small (and keeps float reduction order fixed)."""
    if steps < 1 or batch_size < 1 or seq_len < 8:
        raise ValueError(f"need steps >= 1, batch_size >= 1, seq_len >= 8; got {steps}, {batch_size}, {seq_len}")
    out = Path(out)
    with torch_threads(threads):
        started = time.time()
        torch.manual_seed(seed)
        tokenizer = build_byte_tokenizer()
        streams = training_streams(tokenizer, max_bytes, seed)
        model = Qwen3ForCausalLM(toy_target_config())
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
        warmup = max(1, steps // 20)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))
        )
        gen = torch.Generator().manual_seed(seed)
        losses = []
        model.train()
        bar = tqdm(range(steps), desc="train toy target", unit="step", disable=not progress)
        for _ in bar:
            batch = sample_batch(streams, batch_size, seq_len, gen)
            logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE), batch[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(round(loss.item(), 4))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")

        model.eval()
        model.generation_config = GenerationConfig(
            eos_token_id=[IM_END_ID, ENDOFTEXT_ID], pad_token_id=ENDOFTEXT_ID, do_sample=False
        )
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        log = {
            "steps": steps,
            "batch_size": batch_size,
            "seq_len": seq_len,
            "lr": lr,
            "seed": seed,
            "code_tokens": len(streams[0]),
            "chat_tokens": len(streams[1]),
            "tokens_seen": steps * batch_size * seq_len,
            "seconds": round(time.time() - started, 1),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "losses": losses,
        }
        (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
        return log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/train_toy_target.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder to write the trained target to")
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=WINDOW)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--max-bytes", type=int, default=2_000_000, help="stdlib source bytes to read")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for this model)")
    args = parser.parse_args(argv)
    log = train_toy_target(
        args.out,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        max_bytes=args.max_bytes,
        seed=args.seed,
        threads=args.threads,
    )
    print(f"trained in {log['seconds']} s: loss {log['losses'][0]} -> {log['losses'][-1]}; saved to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
