"""The cost profile of a production-shaped round (`profile_costs`), and the speed-up each method buys per token
of tau there.

A random-weight target of Qwen3 decoder layers at the production shape (H 5120, 64 layers, 64 query and 8 KV
heads of 128, intermediate 25,600, V 248,320: the target's forward modelled by its decoder layers) and a random
drafter of the Qwen3.6-27B DFlash shape (H 5120, 5 layers, 1.78 B parameters, block 16), in bf16 on one device:
the timed pieces (`profile.timing`), the costs JSON (`--json`), and per method the cost factor
T_target(1, L) / (T_draft + T_verify + overhead), the predicted speed-up of a round that accepts one token: a
report's tau times it is the method's predicted speed-up on this device (`scoring.speed`).

    python benchmarks/bench_profile.py --size production --device cuda --json costs.json   # one GPU, about a minute
    python benchmarks/bench_profile.py --smallest                                          # the same at toy size, CPU
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_callbacks.model import DrafterConfig, build_drafter, build_target_layer_ids  # noqa: E402
from dflash_callbacks.profile.timing import profile_costs  # noqa: E402
from dflash_callbacks.scoring.speed import Shape, round_seconds  # noqa: E402
from dflash_callbacks.profile.timing import verified_tokens  # noqa: E402

SIZES = {
    "production": dict(hidden=5120, target_layers=64, target_heads=64, intermediate=25600, vocab=248_320,
                       drafter_layers=5, drafter_heads=40, drafter_intermediate=17408, kv_heads=8, head_dim=128,
                       block=16, contexts=[512, 2048, 8192], budgets=[4, 8, 16, 32], dtype=torch.bfloat16),
    "toy": dict(hidden=64, target_layers=4, target_heads=4, intermediate=128, vocab=1000, drafter_layers=1,
                drafter_heads=4, drafter_intermediate=128, kv_heads=2, head_dim=16, block=8, contexts=[32, 96],
                budgets=[4, 8], dtype=torch.float32),
}


def models(size: dict, device: torch.device):
    """A random target and drafter of `size`, made in its dtype on `device` (no fp32 copy on the way)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(size["dtype"])
    try:
        with torch.device(device):
            target = Qwen3ForCausalLM(Qwen3Config(
                vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=size["intermediate"],
                num_hidden_layers=size["target_layers"], num_attention_heads=size["target_heads"],
                num_key_value_heads=size["kv_heads"], head_dim=size["head_dim"], max_position_embeddings=16384,
                tie_word_embeddings=False))
            drafter = build_drafter(DrafterConfig(
                hidden_size=size["hidden"], intermediate_size=size["drafter_intermediate"],
                num_hidden_layers=size["drafter_layers"], num_attention_heads=size["drafter_heads"],
                num_key_value_heads=size["kv_heads"], head_dim=size["head_dim"], block_size=size["block"],
                mask_token_id=size["vocab"] - 1, vocab_size=size["vocab"], num_target_layers=size["target_layers"],
                target_layer_ids=build_target_layer_ids(size["target_layers"], size["drafter_layers"])))
    finally:
        torch.set_default_dtype(previous)
    return target.eval(), drafter.to(device=device, dtype=size["dtype"]).eval()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="production")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's own)")
    p.add_argument("--smallest", action="store_true", help="--size toy --device cpu --repeats 2 --threads 1")
    p.add_argument("--json", type=Path, default=None, help="write the costs JSON here")
    args = p.parse_args(argv)
    if args.smallest:
        args.size, args.device, args.repeats, args.threads = "toy", "cpu", 2, 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    size, device = SIZES[args.size], torch.device(args.device)
    started = time.perf_counter()
    target, drafter = models(size, device)
    built = time.perf_counter() - started
    blocks = [size["block"], size["block"] // 2]
    costs = profile_costs(target, drafter, block_sizes=blocks, ddtree_budgets=size["budgets"],
                          contexts=size["contexts"], batch_size=args.batch_size, repeats=args.repeats, warmup=2)
    if args.json is not None:
        costs.to_json(args.json)
    print(f"# {' '.join(shlex.quote(a) for a in ['python', 'benchmarks/bench_profile.py', *(argv or sys.argv[1:])])}")
    params = sum(t.numel() for t in drafter.parameters()) / 1e9
    print(f"{costs.device}, {costs.dtype}, batch {costs.batch_size}, size {args.size} (drafter {params:.2f} B "
          f"parameters); built in {built:.0f} s, profiled in {time.perf_counter() - started - built:.0f} s")
    print("\n| L | T_target(1) ms | T_target(n max) ms | " + " | ".join(f"T_draft({b}) ms" for b in blocks) + " |")
    print("|---|---|---|" + "---|" * len(blocks))
    for L in costs.contexts:
        print(f"| {L} | {1000 * costs.target_forward(1, L):.2f} | {1000 * costs.target_forward(costs.largest_n, L):.2f} "
              f"(n = {costs.largest_n}) | " + " | ".join(f"{1000 * costs.draft_round(b):.2f}" for b in blocks) + " |")
    print("\nspeed-up per token of tau, T_target(1, L) / T_round (a report's tau times it is the predicted speed-up):\n")
    print("| method | " + " | ".join(f"L = {L}" for L in costs.contexts) + " |")
    print("|---|" + "---|" * len(costs.contexts))
    for B in blocks:
        proposals = len(drafter.draft_rows(B))
        for (kind, n), name in zip(verified_tokens(proposals, size["budgets"], ()),
                                   ["vanilla", *[f"ddtree@{N}" for N in size["budgets"]]]):
            shape = Shape(B, n, kind == "tree")
            print(f"| {name}:b{B} | " + " | ".join(
                f"{costs.target_forward(1, L) / round_seconds(costs, shape, L):.3f}" for L in costs.contexts) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
