"""Extract a hidden-state cache from a target model with transformers.

For each task: the prompt (through the target's chat template, unless disabled), the
target's greedy completion (`generate(do_sample=False)`, KV cache, stop at EOS or after
`max_new_tokens`), then one forward over prompt + completion with
`output_hidden_states=True`, keeping `hidden_states[i + 1]` for each layer id `i` (the
published convention: layer id i = output of decoder layer i), concatenated along the
feature dimension, in the dtype the target runs in.

At a temperature > 0 the completions are sampled instead, as a request is served
(`sampling.served_logprobs`: temperature, top-k, top-p), `samples` answers per prompt, each
drawn with its own torch.Generator seeded from `seed` (`Sampling.generator`), and each
token's served log-probability is stored beside it (`target_logprob`, format.py).

Extraction resumes: tasks already in the cache folder (same prompt, file intact) are
skipped, and a killed run leaves no half-written file behind (see format.py).

    python -m dflash_callbacks.cache.extract --target DIR --out DIR --tasks coding10 --layer-ids 1,2
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.generation.streamers import BaseStreamer

from ..checks import check_int, dtype_name
from ..progress import progress as shown
from ..model.target_head import head_fingerprint
from .format import (
    CacheError,
    HiddenStateCache,
    TargetInfo,
    check_task_file,
    new_manifest,
    open_for_writing,
    write_task,
)
from .sampling import Sampling, served_logprobs, served_support
from .tasks import Task, load_tasks, task_name_problem

log = logging.getLogger(__name__)


def resolve_tasks(tasks: str | os.PathLike | Sequence[Task]) -> list[Task]:
    """A task-set name or YAML path -> its tasks; a list of Task is checked for duplicates and
    unusable names (the same check as a task file's)."""
    if isinstance(tasks, (str, os.PathLike)):
        return load_tasks(tasks)
    tasks = list(tasks)
    problems = [p for p in map(task_name_problem, (t.name for t in tasks)) if p]
    if problems:
        raise ValueError("; ".join(problems))
    names = [t.name for t in tasks]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"duplicate task names {duplicates}")
    if not tasks:
        raise ValueError("no tasks to extract")
    return tasks


def check_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    layer_ids = [int(i) for i in layer_ids]
    if not layer_ids:
        raise ValueError("layer_ids is empty: give the target layers the drafter reads, e.g. 1,16,31")
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"layer_ids {layer_ids} has duplicates")
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"layer ids {bad} are out of range for a target with {num_layers} decoder layers (valid: 0..{num_layers - 1})"
        )
    return layer_ids


def check_target_folder(path: str | os.PathLike) -> Path:
    """A local transformers model folder (this package never downloads: no hub names)."""
    folder = Path(path)
    if folder.is_file():
        raise FileNotFoundError(f"target {folder} is a file: give the target model's folder (e.g. {folder.parent})")
    if not folder.is_dir():
        raise FileNotFoundError(f"target folder {folder} does not exist (a local transformers model folder is "
                                "needed; nothing is downloaded)")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"target folder {folder} has no config.json: it is not a transformers model folder")
    return folder


def load_target(path: str | os.PathLike, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of a local transformers folder; nothing is downloaded."""
    path = check_target_folder(path)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model.to(device).eval(), tokenizer


def target_info(config, dtype: torch.dtype, path: str | os.PathLike) -> TargetInfo:
    """What a cache records of the target in `path` (its transformers `config`) run in `dtype`."""
    config = config.get_text_config()
    return TargetInfo(
        path=str(Path(path).resolve()),
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        dtype=dtype_name(dtype),
        head=head_fingerprint(path),
    )


def prompt_token_ids(tokenizer, prompt: str, chat_template: bool) -> list[int]:
    if not chat_template:
        return tokenizer(prompt).input_ids
    if not tokenizer.chat_template:
        raise ValueError("the target's tokenizer has no chat template; extract with chat_template=False (--no-chat-template)")
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def stop_token_ids(model, tokenizer) -> tuple[list[int], int | None]:
    """(EOS ids that end a completion, pad id) from the generation config, else the tokenizer."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else None)
    return eos, pad


class TokenProgress(BaseStreamer):
    """Advances a tqdm bar by one per generated token (the first put() is the prompt)."""

    def __init__(self, bar: tqdm):
        self.bar, self.seen_prompt = bar, False

    def put(self, value: torch.Tensor) -> None:
        if self.seen_prompt:
            self.bar.update(1)
        self.seen_prompt = True

    def end(self) -> None:
        pass


@torch.no_grad()
def greedy_generate(model, input_ids: torch.Tensor, max_new_tokens: int, eos: list[int], pad: int | None, streamer=None):
    """Greedy completion of `input_ids` [B, P] (no padding: equal-length prompts): [B, P + n].
    Every logits processor that could bend greedy decoding is set to neutral explicitly,
    so a target's generation_config cannot change the text."""
    return model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        use_cache=True,
        eos_token_id=eos or None,
        pad_token_id=pad,
        streamer=streamer,
    )


def cache_argument(model) -> str:
    """The name the model's forward takes its KV cache by (transformers 5: `cache`, before: `past_key_values`)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def crop_cache(kv: DynamicCache, length: int) -> None:
    """Keep the first `length` positions of `kv` (a negative crop removes that many from the
    end in every transformers version; a crop of 0 does not mean the same in all)."""
    extra = kv.get_seq_length() - length
    if extra > 0:
        kv.crop(-extra)


@torch.no_grad()
def sampled_generate(model, input_ids: torch.Tensor, sampling: Sampling, generators: Sequence[torch.Generator],
                     max_new_tokens: int, eos: list[int]) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """One answer per generator to the prompt `input_ids` [1, P], drawn from the served
    distribution with that generator (KV cache; all answers side by side, until each has
    reached EOS or `max_new_tokens`): (tokens [n, P + m], served log-probability of each
    drawn token [n, m] float32, the served distribution's support at each drawn token (`served_support`:
    ids [n, m, S], probs [n, m, S], dropped [n, m])). Rows that ended early go on past their EOS; cut them
    there."""
    n = len(generators)
    ids = input_ids.expand(n, -1)
    cache_arg, kv = cache_argument(model), DynamicCache()
    tokens, logprobs, supports = [], [], []
    ended = torch.zeros(n, dtype=torch.bool, device=ids.device)
    eos_ids = torch.tensor(eos, dtype=torch.long, device=ids.device)
    step_ids = ids
    for _ in range(max_new_tokens):
        logits = model(input_ids=step_ids, use_cache=True, **{cache_arg: kv}).logits[:, -1]
        served = served_logprobs(logits, sampling)
        drawn = torch.cat([torch.multinomial(row.exp().cpu(), 1, generator=g) for row, g in zip(served, generators)])
        step_ids = drawn.to(ids.device)[:, None]
        tokens.append(step_ids)
        logprobs.append(served.gather(1, step_ids))
        supports.append(served_support(served))
        ended |= torch.isin(step_ids[:, 0], eos_ids)
        if bool(ended.all()):
            break
    support = tuple(torch.stack(parts, dim=1).cpu() for parts in zip(*supports))
    return torch.cat([ids, *tokens], dim=1), torch.cat(logprobs, dim=1).float(), support


def answer_length(tokens: torch.Tensor, prompt_len: int, eos: list[int]) -> int:
    """Tokens of one answer row up to and including its first EOS after the prompt (all without one)."""
    stops = [t for t in range(prompt_len, tokens.shape[0]) if int(tokens[t]) in eos]
    return stops[0] + 1 if stops else tokens.shape[0]


@torch.no_grad()
def target_hidden_states(model, input_ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """`input_ids` [B, T] -> [B, T, len(layer_ids) * H]: hidden_states[i + 1] for each layer id i.
    Logits are computed for the last position only where the model allows it ([T, V] is large)."""
    only_last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    out = model(input_ids=input_ids, output_hidden_states=True, use_cache=False, **only_last)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


def extract_cache(
    target: str | os.PathLike,
    out: str | os.PathLike,
    tasks: str | os.PathLike | Sequence[Task],
    layer_ids: Sequence[int],
    *,
    max_new_tokens: int = 512,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    chat_template: bool = True,
    block_size: int | None = None,
    progress: bool = True,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    samples: int = 1,
    seed: int = 0,
) -> HiddenStateCache:
    """Extract (or finish extracting) the cache of `tasks` from the target folder `target`
    into the folder `out`; returns the cache opened for reading.

    `tasks`: a built-in task-set name ("coding10"), a task YAML file, or a list of Task.
    `block_size`: recorded in the manifest as the block size the cache was made for.
    `temperature` 0 is greedy (the default); above 0, `samples` answers per prompt are sampled
    at `temperature`, `top_p` and `top_k` from generators seeded by `seed`, and the manifest
    records them (`sampling`); its tasks are named by `Sampling.answer_names`.
    A rerun finishes an interrupted extraction: it skips tasks whose entry and file are
    intact. A folder holding a cache made otherwise (target shape/dtype/head, layer ids,
    block size, max_new_tokens, chat template, another task list, a task of another
    prompt) is refused, before the target is loaded.
    """
    tasks = resolve_tasks(tasks)
    sampling = Sampling(temperature, top_p, top_k, samples, seed)
    answers = [(task, i, name) for task in tasks for i, name in enumerate(sampling.answer_names(task.name))]
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    check_int("block_size", block_size, 2, optional=True)
    if Path(out).exists() and not Path(out).is_dir():
        raise NotADirectoryError(f"the cache folder {out} is a file: give a folder to create, or an unfinished cache")
    info = target_info(AutoConfig.from_pretrained(check_target_folder(target), local_files_only=True), dtype, target)
    layer_ids = check_layer_ids(layer_ids, info.num_layers)
    header = new_manifest(
        info,
        layer_ids,
        block_size=block_size,
        extraction={"max_new_tokens": max_new_tokens, "chat_template": chat_template, "tasks": [t.name for t in tasks]},
        sampling=sampling,
    )
    manifest = open_for_writing(out, header)
    done = {entry["name"]: entry for entry in manifest["tasks"]}
    other = [name for task, _, name in answers if name in done and done[name].get("prompt") not in (None, task.prompt)]
    if other:
        raise CacheError(f"{out} holds the tasks {other} extracted from other prompts: write to another folder "
                         "or delete this one")
    todo: dict[str, list[int]] = {}  # task name -> its answers to (re-)extract
    for task, i, name in answers:
        if name in done:
            try:
                check_task_file(Path(out), done[name])
                log.info("%s: already in the cache, skipped", name)
                continue
            except CacheError as e:
                log.warning("%s: re-extracting, %s", name, e)
        todo.setdefault(task.name, []).append(i)
    if not todo:
        return HiddenStateCache(out)
    model, tokenizer = load_target(target, device=device, dtype=dtype)
    eos, pad = stop_token_ids(model, tokenizer)
    for task in shown([t for t in tasks if t.name in todo], desc="tasks", unit="task", enabled=progress):
        prompt_ids = torch.tensor([prompt_token_ids(tokenizer, task.prompt, chat_template)], device=model.device)
        prompt_len = prompt_ids.shape[1]
        if sampling.greedy:
            with shown(total=max_new_tokens, desc=task.name, unit="tok", nested=True, enabled=progress) as bar:
                ids = greedy_generate(model, prompt_ids, max_new_tokens, eos, pad, streamer=TokenProgress(bar))
            hidden = target_hidden_states(model, ids, layer_ids)
            write_task(out, task.name, ids[0].cpu(), hidden[0].cpu(), prompt_len, prompt=task.prompt)
            log.info("%s: extracted %d prompt + %d completion tokens", task.name, prompt_len, ids.shape[1] - prompt_len)
            continue
        generators = [sampling.generator(task.name, i) for i in range(sampling.samples)]  # all: the same batch each run
        ids, logprobs, (support_ids, support_probs, _) = sampled_generate(model, prompt_ids, sampling, generators,
                                                                           max_new_tokens, eos)
        hidden = target_hidden_states(model, ids, layer_ids)  # causal: a row's answer ignores what follows its EOS
        names = sampling.answer_names(task.name)
        for i in todo[task.name]:
            length = answer_length(ids[i], prompt_len, eos)
            logprob = torch.cat([torch.zeros(prompt_len), logprobs[i, : length - prompt_len].cpu()])
            width = support_ids.shape[-1]
            support = (torch.cat([torch.full((prompt_len, width), -1, dtype=torch.int32), support_ids[i, : length - prompt_len]]),
                       torch.cat([torch.zeros(prompt_len, width), support_probs[i, : length - prompt_len]]))
            write_task(out, names[i], ids[i, :length].cpu(), hidden[i, :length].cpu(), prompt_len, prompt=task.prompt,
                       target_logprob=logprob, sample=i, support=support)
            log.info("%s: sampled %d prompt + %d completion tokens", names[i], prompt_len, length - prompt_len)
    return HiddenStateCache(out)


# ---------------------------------------------------------------- command line
