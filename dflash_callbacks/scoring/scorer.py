"""The batched scorer: every valid anchor of a task, many blocks per drafter forward.

For a task with tokens tok[0..T) and prompt length P, the anchors are P .. T-2 (cut to
the first `window` tokens of the completion). Per anchor a the block is
[tok[a], MASK x (B-1)] at positions a..a+B-1 and sees the context [0, a) and itself;
labels are tok[a+1 .. a+B-1], invalid past the end of the sequence.

- The context keys and values of every layer are computed once per task
  (`DFlashDrafter.encode_context`) and shared by all blocks.
- `anchors_per_forward` blocks are decoded side by side in one forward; block i sees
  keys [0, a_i) and its own B keys, in two exact parts (`model.block_attention`), as
  each layer's attention pattern allows (`ScoringConfig.attention`: "auto" is as vLLM
  serves the drafter, `model.attention`).
- On a sampled cache, where the family samples its proposal at the cache's temperature
  (`acceptance.ServedDraft`: DFlash 2's selector walk, DFlash's probabilistic draft rule), vanilla's
  acceptance at each slot is a coin of chance min(1, q / p): the report keeps the expected
  streak of every anchor and one seeded draw of the coins (`summarize`).
- A pruned draft vocabulary (`DFlashDrafter.vocab_ids`) is scored over its own target
  ids: the LM head's rows of those ids (ascending, so ties go to the lower target id),
  and a label outside it ends the streak there, as it can never be drafted.
- The LM head never materialises [anchors, B-1, V]: `kernels.head_stats` streams over
  the vocabulary and keeps, per (anchor, depth), the log-sum-exp, the label's
  log-prob, rank and order, and the top-N log-probs. It is called once per task with
  the drafts of every chunk (at most `MAX_HEAD_ROWS` rows per call), so the GPU gets
  enough rows to fill it (one task: ~7,700 rows; one chunk of 64 anchors: 960).
  Streaks follow from those alone: vanilla from the label's order, top@k from its
  rank, DDTree from the closed form (`kernels.ddtree.ddtree_streaks_from_top`).
- With `confidence_threshold` (a drafter with a confidence head: DSpark), each anchor's
  proposal is cut before the first slot whose confidence is below it, teacher-forced
  (`families.dspark.confidence_cut`), and every method's streak is min(streak, cut): what a
  served, cut block gets accepted. The task's `confidence_reach` gives, per depth, the share of
  anchors whose cut reaches it.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ..kernels.ddtree import ddtree_streaks_from_stats
from ..progress import progress as shown
from ..model import DFlashDrafter, TargetHead
from ..model.attention import describe, resolve_attention
from ..model.families.dspark import confidence_cut
from ..model.geometry import anchor_range, block_inputs
from .aggregates import Streaks, acceptance_curve, encode_expected, encode_streaks, quantize_expected, task_numbers
from .config import ScoringConfig, block_size_problems
from .intervals import report_intervals
from .methods import Method, scored_methods
from .report import SCORER_VERSION, EvalReport
from .acceptance import ServedDraft, coins, conditional_streaks, expected_streaks, served_problems, slot_chances


class NonFiniteError(ValueError):
    """NaN or Inf where a score would come from: an error for that report, never a number."""


def streaks_from_stats(stats, valid: torch.Tensor, config: ScoringConfig,
                       ddtree: Callable = ddtree_streaks_from_stats) -> dict[str, torch.Tensor]:
    """Per-anchor streaks of every configured method from the statistics of each slot's distribution
    (`drafter.slot_stats`, rows viewed as [n, P]); DDTree by `ddtree(stats, valid, budgets)` (the
    drafter's `ddtree_streaks`; by default the closed form of independent slots).

    NaN or Inf logits would otherwise count as acceptance (no logit is greater than a
    NaN label logit, so its rank is 0): a non-finite log-sum-exp or a NaN label log-prob on any
    row raises NonFiniteError instead (a label log-prob of -inf is a label the family can not
    propose there, e.g. outside DFlash 2's candidates).
    """
    n, depth = valid.shape
    finite = torch.isfinite(stats.lse) & ~torch.isnan(stats.label_logprob) & (stats.label_logprob < math.inf)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        raise NonFiniteError(
            f"the drafter's logits are NaN or Inf at {bad} of {finite.numel()} (anchor, depth) rows "
            f"(NaN hidden states or weights, or an overflow in {stats.lse.dtype}-accumulated scoring "
            "of a low-precision dtype: try scoring.dtype=float32)"
        )

    def leading(ok: torch.Tensor) -> torch.Tensor:
        return (ok & valid).long().cumprod(dim=1).sum(dim=1)

    ddtree = ddtree(stats, valid, config.ddtree_budgets) if config.ddtree_budgets else {}
    out = {}
    for method in scored_methods(config.ddtree_budgets, config.topk):
        if method.kind == "vanilla":
            out[str(method)] = leading(stats.label_order.view(n, depth) == 0)
        elif method.kind == "ddtree":
            out[str(method)] = ddtree[method.n]
        else:
            out[str(method)] = leading(stats.label_rank.view(n, depth) < method.n)
    return out


MAX_HEAD_ROWS = 16384
"""Most draft rows per `head_stats` call (whole chunks; a chunk above it goes alone):
the drafts held until the call cost MAX_HEAD_ROWS x H in the drafter's dtype (168 MB
in bf16 at H = 5120)."""
HEAD_STATS_BYTES = 3 * 4 * (1 << 23)
"""The torch path's working set beside its inputs: a [rows, tile] fp32 logit tile of
TILE_ELEMENTS (2^23) and two temporaries of its size."""


@dataclass(frozen=True)
class MemoryPlan:
    """Chunk sizes of `score_task`: blocks per drafter forward, draft rows per head_stats call."""

    anchors_per_forward: int
    head_rows: int


def memory_needs(config: ScoringConfig, drafter, vocab: int, longest_task: int, block_size: int) -> tuple[int, int, int]:
    """Estimated bytes (resident, per anchor of a forward, per held draft row), in the
    scoring dtype b, for a context of T tokens: resident = the drafter, the target's
    embedding and LM head, one task's hidden states and context keys and values, and the
    LM-head path's tiles; per anchor = B queries' activations (4H + 2I) b, their context
    attention scores 2 heads T x 4 (fp32, materialised where no fused kernel returns the
    log-sum-exp) and mask T b; per draft row = H b."""
    cfg, b = drafter.config, config.torch_dtype.itemsize
    H, T = cfg.hidden_size, longest_task
    resident = (sum(p.numel() for p in drafter.parameters()) * b + 2 * vocab * H * b
                + T * cfg.num_target_features * b
                + cfg.num_hidden_layers * 2 * T * cfg.num_key_value_heads * cfg.head_dim * b + HEAD_STATS_BYTES)
    per_anchor = block_size * ((4 * H + 2 * cfg.intermediate_size) * b + 2 * cfg.num_attention_heads * T * 4 + T * b)
    return resident, per_anchor, H * b


def memory_plan(config: ScoringConfig, drafter, vocab: int, longest_task: int, block_size: int) -> MemoryPlan:
    """The largest chunks (up to `anchors_per_forward` and MAX_HEAD_ROWS) whose estimated
    working set (`memory_needs`) fits `config.max_memory_gib`, half of what is left beside
    the resident part to each; ValueError when even one block does not fit."""
    if config.max_memory_gib is None:
        return MemoryPlan(config.anchors_per_forward, MAX_HEAD_ROWS)
    resident, per_anchor, per_row = memory_needs(config, drafter, vocab, longest_task, block_size)
    free = config.max_memory_gib * 2**30 - resident
    if free < per_anchor + block_size * per_row:
        need = (resident + per_anchor + block_size * per_row) / 2**30
        raise ValueError(f"scoring.max_memory_gib={config.max_memory_gib:g} is below what scoring needs at the least: "
                         f"about {need:.2f} GiB (the drafter, the target head, one task, one block); raise it")
    return MemoryPlan(
        anchors_per_forward=max(1, min(config.anchors_per_forward, int(free / 2 // per_anchor))),
        head_rows=max(block_size - 1, min(MAX_HEAD_ROWS, int(free / 2 // per_row))),
    )


@dataclass
class TaskStreaks:
    name: str
    first_anchor: int
    streaks: dict[str, torch.Tensor]  # method -> int64 [n_anchors] (cpu)
    accept: dict[str, torch.Tensor] = field(default_factory=dict)
    """method -> float64 [n_anchors, P] (cpu): each slot's chance of acceptance where the draft is sampled
    (`acceptance.ServedDraft.acceptance`); such a method's `streaks` entry is replaced by a draw of its coins."""
    cuts: dict[str, torch.Tensor] | None = None  # method -> the confidence cut per anchor (with a threshold)
    alpha: dict[str, torch.Tensor] = field(default_factory=dict)
    """method -> float64 [n_anchors, P] (cpu): each slot's chance of acceptance given the text before it, on a
    cache that keeps the served support (`acceptance.slot_chances`); the method is then scored by the conditional
    estimators (`acceptance.conditional_streaks`), its `accept` entry c given the emitted token."""


@torch.no_grad()  # grad mode and autocast are the calling thread's: set here, restored on return
@torch.autocast("cpu", enabled=False)  # a caller's autocast region would recast the drafter's matmuls
@torch.autocast("cuda", enabled=False)
def score_task(
    drafter: DFlashDrafter,
    head: TargetHead,
    task,
    config: ScoringConfig,
    block_size: int,
    progress: bool = False,
    plan: MemoryPlan | None = None,
    attention_rule: str | None = None,
    served: ServedDraft | None = None,
) -> TaskStreaks:
    """Per-anchor streaks of one cache task (drafter and head already on one device/dtype),
    in chunks of `plan` (default: `anchors_per_forward` blocks, MAX_HEAD_ROWS draft rows), under
    `attention_rule` (default `config.attention`); with a sampled `served` draft, vanilla's chances of
    acceptance too (`TaskStreaks.accept`; the task's `target_logprob` holds each label's log p)."""
    plan = plan or MemoryPlan(config.anchors_per_forward, MAX_HEAD_ROWS)
    sampled = served is not None and served.sampled
    if sampled and task.target_logprob is None:
        raise ValueError(f"task {task.name!r} has no target_logprob: a sampled draft is scored on a sampled cache")
    conditional = conditional_scoring(served, task, config)
    device, dtype = drafter.input_weight.device, drafter.input_weight.dtype
    anchors = anchor_range(task.prompt_len, task.num_tokens, config.window)
    if len(anchors) == 0:
        raise ValueError(f"task {task.name!r} has no valid anchor (prompt {task.prompt_len}, {task.num_tokens} tokens)")
    input_ids = task.input_ids.to(device)
    context_len = anchors[-1]  # the last anchor sees [0, a_last)
    target_hidden = task.hidden[:context_len].to(device=device, dtype=dtype)[None]
    context = drafter.encode_context(target_hidden, torch.arange(context_len, device=device)[None])
    top_n = max(config.ddtree_budgets, default=0)
    attention = resolve_attention(drafter.config, attention_rule or config.attention, head.model_window)
    vocab_ids = drafter.vocab_ids
    proposals = len(drafter.draft_rows(block_size))
    weight = drafter.head_weight(head.lm_head.weight)
    threshold = config.confidence_threshold
    parts: dict[str, list[torch.Tensor]] = {}
    accepts: list[torch.Tensor] = []
    alphas: list[torch.Tensor] = []
    cuts: list[torch.Tensor] = []
    pending: list[tuple[torch.Tensor, ...]] = []  # (slot features, labels, predecessors, valid, cut, log p, support) per chunk
    tempered = {} if served is None or served.head_temperature is None else {"temperature": served.head_temperature}
    logprob = task.target_logprob.to(device) if sampled or conditional else None
    support = (task.support_ids.to(device), task.support_probs.to(device)) if conditional else None

    def flush() -> None:
        features, labels, previous, valid, cut, logp, ids, probs = (torch.cat(t) for t in zip(*pending))  # [n, P, ...]
        pending.clear()
        stats = drafter.slot_stats(features, weight, labels, previous, top_n, config.backend, config.vocab_chunk,
                                   **tempered)
        for method, values in streaks_from_stats(stats, valid, config, drafter.ddtree_streaks).items():
            parts.setdefault(method, []).append((values if threshold is None else torch.minimum(values, cut)).cpu())
        cuts.append(cut.cpu())
        # a slot past the confidence cut is never proposed: its chance is 0
        inside = valid & (torch.arange(proposals, device=valid.device) < cut[:, None])
        if conditional:
            accept, alpha = slot_chances(served, stats, features, weight, vocab_ids, logp, (ids, probs), inside)
            accepts.append(accept.cpu())
            alphas.append(alpha.cpu())
        elif sampled:
            accepts.append(served.acceptance(stats, logp, inside).cpu())

    chunks = range(0, len(anchors), plan.anchors_per_forward)
    for start in shown(chunks, desc=task.name, enabled=progress, nested=True, unit="chunk"):
        span = anchors[start : start + plan.anchors_per_forward]  # a range: no host-device sync per chunk
        C, chunk = span[-1], torch.arange(span.start, span.stop, device=device)
        tokens, labels, valid = block_inputs(input_ids, chunk, block_size, drafter.mask_token_id, proposals)
        previous = torch.cat([tokens[:, :1], labels[:, :-1]], dim=1)  # the true token before each slot
        if vocab_ids is not None:
            labels, valid = draft_labels(labels, valid, vocab_ids.to(device))
        hidden = drafter.decode_blocks([(k[:, :, :C], v[:, :, :C]) for k, v in context],
                                       head.embed_tokens(tokens).to(dtype), chunk, attention)
        features = drafter.slot_features(hidden, previous, head.embed_tokens)
        cut = torch.full_like(chunk, proposals) if threshold is None else \
            confidence_cut(drafter.confidence_logits(hidden, previous), threshold)
        if pending and sum(p[0].shape[0] * proposals for p in pending) + features.shape[0] * proposals > plan.head_rows:
            flush()
        # each label's position (the token at a + 1 + j): its served log p and support; unread without them
        where = (chunk[:, None] + torch.arange(1, proposals + 1, device=device)).clamp(max=task.num_tokens - 1)
        logp = logprob[where] if logprob is not None else valid
        ids, probs = (support[0][where], support[1][where]) if conditional else (valid, valid)
        pending.append((features, labels, previous, valid, cut, logp, ids, probs))
    flush()
    accept = {"vanilla": torch.cat(accepts)} if accepts else {}
    alpha = {"vanilla": torch.cat(alphas)} if alphas else {}
    cut = None if threshold is None else torch.cat(cuts)
    return TaskStreaks(task.name, anchors[0], {m: torch.cat(v) for m, v in parts.items()}, accept,
                       None if cut is None else dict.fromkeys(parts, cut), alpha)


def conditional_scoring(served: ServedDraft | None, task, config: ScoringConfig) -> bool:
    """Whether vanilla is scored with the conditional estimators (`acceptance.slot_chances`): a sampled cache that
    keeps the served support, a live schedule that runs to the answers' ends. Else a sampled cache's vanilla
    is scored as before (the coin draw, the integer streaks of an argmax draft), and the report says which."""
    return served is not None and served.temperature > 0 and task.support_ids is not None \
        and config.max_rounds is None and config.estimators == "conditional"


def draft_labels(labels: torch.Tensor, valid: torch.Tensor, vocab_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target-id labels as indices into a pruned draft vocabulary (`vocab_ids`, ascending);
    a label outside it is no longer valid (the streak stops there: it can not be drafted)."""
    index = torch.searchsorted(vocab_ids, labels).clamp_(max=vocab_ids.numel() - 1)
    inside = vocab_ids[index] == labels
    return torch.where(inside, index, 0), valid & inside


def summarize(task: TaskStreaks, config: ScoringConfig, max_taus: dict[str, int]) -> dict[str, dict]:
    """The report entry of one task: per method each aggregate (`aggregates.AGGREGATES`), the acceptance
    curve, the live rounds, and the per-anchor streaks they come from (for the intervals); with a confidence
    threshold, the share of anchors whose confidence cut reaches each depth (`confidence_reach`, as
    `families.dspark.cut_reach`); `max_taus`: each method's largest tau. A method with chances of acceptance
    (`TaskStreaks.accept`, a sampled draft) keeps its expected streaks (`expected`, as the report stores them:
    every number is made from those) and, as `streaks`, one draw of the coins (`acceptance.coins`, seeded with
    scoring.coin_seed); its curve is the mean chance of reaching each depth. A method with chances given the
    text before each slot too (`TaskStreaks.alpha`, a cache that keeps the served support) keeps the conditional
    expected streaks and the live schedule's expected visits of each anchor (`visits`)."""
    out = {}
    for method, values in task.streaks.items():
        top = max_taus[method]
        accept, alpha = task.accept.get(method), task.alpha.get(method)
        if accept is None:
            streaks, curve, kept = Streaks(values.numpy()), acceptance_curve(values.numpy(), top - 1), {}
        elif alpha is not None:  # the conditional estimators: no coin in dense, the expected rounds in live
            drawn = expected_streaks(accept.numpy(), coins(config.coin_seed, task.name, *accept.shape)).drawn
            found = conditional_streaks(accept.numpy(), alpha.numpy())
            streaks = Streaks(drawn, quantize_expected(found.expected), quantize_expected(found.visits))
            curve = found.reach.mean(axis=0).tolist()
            kept = {"expected": encode_expected(found.expected, top), "visits": encode_expected(found.visits, 2)}
        else:
            found = expected_streaks(accept.numpy(), coins(config.coin_seed, task.name, *accept.shape))
            streaks = Streaks(found.drawn, quantize_expected(found.expected))
            curve, kept = found.reach.mean(axis=0).tolist(), {"expected": encode_expected(found.expected, top)}
        out[method] = task_numbers(streaks, task.first_anchor, config.max_rounds)
        out[method].update(curve=curve, anchors=int(streaks.drawn.size), streaks=encode_streaks(streaks.drawn, top),
                           **kept)
        if task.cuts is not None:
            out[method]["confidence_reach"] = acceptance_curve(task.cuts[method].numpy(), top - 1)
    return out


def family_of(drafter: DFlashDrafter, blocks: list[int]) -> dict:
    """What a report records of the drafter's family: its name, the tokens its block proposes at each block
    size scored, and its settings (`EvalReport.family`)."""
    settings = drafter.config.family_config
    return {"name": drafter.family, "proposals": {str(b): len(drafter.draft_rows(b)) for b in blocks},
            "settings": None if settings is None else dataclasses.asdict(settings)}


def block_problems(drafter_config, config: ScoringConfig, trained: int | None = None, *,
                   run_block: bool = True) -> list[str]:
    """What stops `config` from scoring a drafter of `drafter_config` (trained at block `trained`, default its
    own): a block size above the trained one (its slots past the trained block never learnt to draft), with
    `run_block` block_sizes holding the block it is scored at (the drafter's, scoring.block_size unset: that
    config refuses an explicit one itself), DDTree for a family whose slots read the token before them
    (`Drafter.ddtree_refusal`), and a confidence threshold for a drafter without a confidence head
    (`Drafter.confidence_refusal`)."""
    from ..model import build_drafter
    from ..model.families import family_named

    problems = block_size_problems(config, trained or drafter_config.block_size, run_block=run_block)
    with torch.device("meta"):  # the refusals may depend on the family's settings: nothing is allocated
        drafter = build_drafter(drafter_config)
    title = family_named(drafter_config.family).title
    if config.ddtree_budgets and drafter.ddtree_refusal is not None:
        problems.append(f"ddtree@N can not be scored for a {title} drafter: {drafter.ddtree_refusal}; score it "
                        "without DDTree (scoring.ddtree_budgets=[]) and monitor vanilla or top@k (e.g. the stop's "
                        "monitor='vanilla/live')")
    if config.confidence_threshold is not None and drafter.confidence_refusal is not None:
        problems.append(f"scoring.confidence_threshold={config.confidence_threshold:g} can not cut a {title} "
                        f"drafter's block: {drafter.confidence_refusal}; leave it None (the full block)")
    return problems


def _report_cache(cache, head: TargetHead) -> dict:
    """What a report records of its inputs: the cache (path, fingerprint), when the head was read from a
    target folder the target head's fingerprint, and a sampled cache's settings (`cache.sampling`)."""
    out = {"path": str(cache.path), "fingerprint": cache.fingerprint}
    if head.fingerprint is not None:
        out["target"] = head.fingerprint
    if cache.sampling is not None:
        out["sampling"] = cache.sampling.to_dict()
    return out


def attention_patterns(drafter_config, rule: str, block_size: int,
                       target_window: int | None = None) -> dict[str, list[str]] | None:
    """Each layer's pattern as its trainer trained it (`model.attention`'s "trained") and as vLLM serves it
    ("vllm", its layers without a window given the engine's `target_window`), where the two, or either and the
    scored `rule`'s, differ for blocks of up to `block_size`; None where all three agree (what
    `EvalReport.attention_patterns` records: the report says so once, and `scoring.attentions` scores the
    others as methods of their own, e.g. `attention: vllm` beside `attentions: [auto]` what the target's
    window costs)."""
    def seen(name: str) -> list[str]:  # a window over the context only hides nothing more when the block fits in it
        return [str(replace(a, context_only=False) if a.context_only and block_size <= a.window else a)
                for a in resolve_attention(drafter_config, name, target_window)]

    found = {name: seen(name) for name in ("trained", "vllm")}
    if found["trained"] == found["vllm"] == seen(rule):
        return None
    return {name: describe(resolve_attention(drafter_config, name, target_window)) for name in found}


class Cancelled(RuntimeError):
    """Scoring was cancelled between two tasks (`score_drafter(cancel=...)`)."""


def score_drafter(
    drafter: DFlashDrafter,
    cache,
    head: TargetHead,
    config: ScoringConfig | None = None,
    *,
    step: int | None = None,
    snapshot_id: str | None = None,
    name: str | None = None,
    progress: bool = False,
    cancel: threading.Event | None = None,
    owns_process: bool = False,
) -> EvalReport:
    """Score `drafter` on every task of `cache` (a HiddenStateCache). The drafter and the
    head are moved to the configured device and dtype (in place). NaN or Inf anywhere on
    the way raises NonFiniteError naming the task; a set `cancel` event raises Cancelled
    before the next task. The report carries a 95% interval for every mean
    (`intervals.report_intervals`), its time counted in `seconds`.

    torch counts one peak of allocated memory per device for the whole process: only a
    scorer that `owns_process` (nothing else uses the device here) resets it and reports
    its peak; beside a training run the count is left alone (it is training's) and the
    report's `peak_memory` is None."""
    config = config or ScoringConfig()
    started, clock = time.time(), time.perf_counter()  # when (created) and how long (seconds)
    drafter_block = drafter.config.block_size
    block_size = config.block_size or drafter_block
    blocks = [block_size, *config.block_sizes]  # every method at each: `:bB` past the first
    problems = block_problems(drafter.config, config) + served_problems(config, cache.sampling, drafter.family,
                                                                         f"the cache {cache.path}")
    if problems:
        raise ValueError("; ".join(problems))
    served = ServedDraft.of(config, cache.sampling, drafter.family)
    rules = config.rules(head.model_window)  # every method under each: `:RULE` past the first
    cache.check_compatible(drafter.config, block_size=block_size)
    problems = drafter.head_problems(head.embed_tokens.weight, head.lm_head.weight)
    if problems:
        raise ValueError("; ".join(problems))
    device, dtype = config.resolved_device(), config.torch_dtype
    drafter = drafter.to(device=device, dtype=dtype).eval()
    head = head.to(device=device, dtype=dtype)
    names = config.tasks or cache.task_names
    unknown = sorted(set(names) - set(cache.task_names))
    if unknown:
        raise ValueError(f"tasks {unknown} are not in the cache; it holds {cache.task_names}")
    longest = max(cache.entry(n)["num_tokens"] for n in names) if config.max_memory_gib is not None else 0
    plan = memory_plan(config, drafter, head.vocab_size, longest, max(blocks))
    measure_peak = owns_process and device.type == "cuda"
    if measure_peak:
        torch.cuda.reset_peak_memory_stats(device)
    family = family_of(drafter, blocks)
    max_taus = {m: family["proposals"][str(Method.parse(m).block or block_size)] + 1
                for m in config.methods_on(head.model_window)}
    tasks = {}
    # one estimator for the whole report: the conditional ones only where every task scored keeps the support
    supported = cache.sampling is not None and all("support" in cache.entry(n) for n in names)
    for task_name in shown(names, desc=f"scoring {name or 'drafter'}", enabled=progress, unit="task"):
        if cancel is not None and cancel.is_set():
            raise Cancelled(f"scoring was cancelled before task {task_name!r}")
        task, streaks, accept, alpha, cuts = cache.task(task_name), {}, {}, {}, {}
        if not supported:
            task = dataclasses.replace(task, support_ids=None, support_probs=None)
        for rule in rules:
            for block in blocks:
                try:
                    found = score_task(drafter, head, task, config, block, progress, plan, rule, served)
                except NonFiniteError as e:
                    raise NonFiniteError(f"task {task_name!r}: {e}") from None
                named = lambda m: str(Method.parse(m).at(None if block == block_size else block).under(rule))  # noqa: E731
                streaks.update({named(m): v for m, v in found.streaks.items()})
                accept.update({named(m): v for m, v in found.accept.items()})
                alpha.update({named(m): v for m, v in found.alpha.items()})
                cuts.update({named(m): v for m, v in (found.cuts or {}).items()})
        tasks[task_name] = summarize(TaskStreaks(task_name, found.first_anchor, streaks, accept, cuts or None, alpha),
                                     config, max_taus)
    report = EvalReport(
        drafter=name or "drafter",
        cache=_report_cache(cache, head),
        block_size=block_size,
        tasks=tasks,
        step=step,
        snapshot_id=snapshot_id,
        drafter_block_size=drafter_block,
        scoring=config.to_dict(),
        seconds=time.perf_counter() - clock,
        peak_memory=torch.cuda.max_memory_allocated(device) if measure_peak else None,
        created=started,
        scorer_version=SCORER_VERSION,
        attention=describe(resolve_attention(drafter.config, config.attention, head.model_window)),
        family=family,
        attention_patterns=attention_patterns(drafter.config, config.attention, max(blocks), head.model_window),
    )
    report.intervals = report_intervals(report)
    report.seconds = time.perf_counter() - clock
    return report
