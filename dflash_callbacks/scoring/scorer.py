"""The batched scorer: every valid anchor of a task, many blocks per drafter forward.

For a task with tokens tok[0..T) and prompt length P, the anchors are P .. T-2 (cut to
the first `window` tokens of the completion). Per anchor a the block is
[tok[a], MASK x (B-1)] at positions a..a+B-1 and sees the context [0, a) and itself;
labels are tok[a+1 .. a+B-1], invalid past the end of the sequence.

- The context keys and values of every layer are computed once per task
  (`DFlashDrafter.encode_context`) and shared by all blocks.
- `anchors_per_forward` blocks are decoded side by side in one forward; block i sees
  keys [0, a_i) and its own B keys, in two exact parts (`model.block_attention`).
- The LM head never materialises [anchors, B-1, V]: `kernels.head_stats` streams over
  the vocabulary and keeps, per (anchor, depth), the log-sum-exp, the label's
  log-prob, rank and order, and the top-N log-probs. Streaks follow from those alone:
  vanilla from the label's order, top@k from its rank, DDTree from the closed form
  (`kernels.ddtree.ddtree_streaks_from_top`).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..kernels.ddtree import ddtree_streaks_from_top
from ..kernels.head_stats import head_stats
from ..model import DFlashDrafter, TargetHead
from ..model.geometry import anchor_range, block_inputs
from .aggregates import acceptance_curve, dense_tau, live_rounds
from .config import ScoringConfig
from .report import EvalReport


def streaks_from_stats(stats, valid: torch.Tensor, config: ScoringConfig) -> dict[str, torch.Tensor]:
    """Per-anchor streaks of every configured method from the LM-head statistics."""
    n, depth = valid.shape

    def leading(ok: torch.Tensor) -> torch.Tensor:
        return (ok & valid).long().cumprod(dim=1).sum(dim=1)

    out = {"vanilla": leading(stats.label_order.view(n, depth) == 0)}
    if config.ddtree_budgets:
        top = stats.top_logprobs.view(n, depth, -1)
        ddtree = ddtree_streaks_from_top(top, stats.label_logprob.view(n, depth), valid, config.ddtree_budgets)
        out.update((f"ddtree@{b}", ddtree[b]) for b in config.ddtree_budgets)
    for k in config.topk:
        out[f"top@{k}"] = leading(stats.label_rank.view(n, depth) < k)
    return out


@dataclass
class TaskStreaks:
    name: str
    first_anchor: int
    streaks: dict[str, torch.Tensor]  # method -> int64 [n_anchors] (cpu)


@torch.no_grad()
def score_task(
    drafter: DFlashDrafter,
    head: TargetHead,
    task,
    config: ScoringConfig,
    block_size: int,
    progress: bool = False,
) -> TaskStreaks:
    """Per-anchor streaks of one cache task (drafter and head already on one device/dtype)."""
    device, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
    anchors = anchor_range(task.prompt_len, task.num_tokens, config.window)
    if len(anchors) == 0:
        raise ValueError(f"task {task.name!r} has no valid anchor (prompt {task.prompt_len}, {task.num_tokens} tokens)")
    input_ids = task.input_ids.to(device)
    context_len = anchors[-1]  # the last anchor sees [0, a_last)
    target_hidden = task.hidden[:context_len].to(device=device, dtype=dtype)[None]
    context = drafter.encode_context(target_hidden, torch.arange(context_len, device=device)[None])
    top_n = max(config.ddtree_budgets, default=0)
    parts: dict[str, list[torch.Tensor]] = {}
    chunks = range(0, len(anchors), config.anchors_per_forward)
    for start in tqdm(chunks, desc=task.name, disable=not progress, leave=False, unit="chunk"):
        chunk = torch.tensor(anchors[start : start + config.anchors_per_forward], device=device)
        C = int(chunk.max())
        tokens, labels, valid = block_inputs(input_ids, chunk, block_size, drafter.mask_token_id)
        hidden = drafter.decode_blocks([(k[:, :, :C], v[:, :, :C]) for k, v in context], head.embed_tokens(tokens).to(dtype), chunk)
        drafts = hidden.view(len(chunk), block_size, -1)[:, 1:].flatten(0, 1)
        stats = head_stats(
            drafts, head.lm_head.weight, labels.flatten(), top_n, backend=config.backend, chunk_size=config.vocab_chunk
        )
        for method, values in streaks_from_stats(stats, valid, config).items():
            parts.setdefault(method, []).append(values.cpu())
    return TaskStreaks(task.name, anchors[0], {m: torch.cat(v) for m, v in parts.items()})


def summarize(task: TaskStreaks, config: ScoringConfig, block_size: int) -> dict[str, dict]:
    """The report entry of one task: per method dense/live tau, curve, live rounds."""
    out = {}
    for method, values in task.streaks.items():
        rounds = live_rounds(values, task.first_anchor, config.max_rounds)
        out[method] = {
            "dense": dense_tau(values),
            "live": sum(rounds) / len(rounds),
            "curve": acceptance_curve(values, block_size - 1),
            "live_rounds": rounds,
            "anchors": int(values.numel()),
        }
    return out


def score_drafter(
    drafter: DFlashDrafter,
    cache,
    head: TargetHead,
    config: ScoringConfig | None = None,
    *,
    step: int | None = None,
    name: str | None = None,
    progress: bool = False,
) -> EvalReport:
    """Score `drafter` on every task of `cache` (a HiddenStateCache). The drafter and the
    head are moved to the configured device and dtype (in place)."""
    config = config or ScoringConfig()
    started = time.time()
    drafter_block = drafter.config.block_size
    block_size = config.block_size or drafter_block
    if block_size != drafter_block:
        warnings.warn(
            f"scoring at block size {block_size} but the drafter was built for {drafter_block}; "
            "the report records both",
            stacklevel=2,
        )
    cache.check_compatible(drafter.config, block_size=block_size)
    device, dtype = config.resolved_device(), config.torch_dtype
    drafter = drafter.to(device=device, dtype=dtype).eval()
    head = head.to(device=device, dtype=dtype)
    names = config.tasks or cache.task_names
    unknown = sorted(set(names) - set(cache.task_names))
    if unknown:
        raise ValueError(f"tasks {unknown} are not in the cache; it holds {cache.task_names}")
    tasks = {}
    for task_name in tqdm(names, desc=f"scoring {name or 'drafter'}", disable=not progress, unit="task"):
        streaks = score_task(drafter, head, cache.task(task_name), config, block_size, progress)
        tasks[task_name] = summarize(streaks, config, block_size)
    return EvalReport(
        drafter=name or "drafter",
        cache={"path": str(cache.path), "fingerprint": cache.fingerprint},
        block_size=block_size,
        tasks=tasks,
        step=step,
        drafter_block_size=drafter_block,
        scoring=config.to_dict(),
        seconds=time.time() - started,
        created=started,
    )
