"""The teacher-forced approximation of tau at a temperature, as trainers log it.

Along a cache's text (usually greedy), at every anchor a (the scorer's anchors and blocks,
`model.geometry`): p_j the target's served distribution of the token at a + j given the text
before it (`served_logprobs`), q_j the drafter's tempered one at slot j (softmax(logits / T), the
proposal of the "sample" draft rule in `served_live`), and

    tau(a) = 1 + sum_k prod_{j <= k} (1 - TV(p_j, q_j)),   TV(p, q) = sum |p - q| / 2,

slots past the end of the text counting 0. 1 - TV(p_j, q_j) is the chance that a draft from q_j
is accepted under p_j; but the text it is taken along is not the one served at T (that is
sampled from the target, and the drafter proposes as it rules), so this is an approximation;
its bias against the served tau is what `benchmarks/bench_served_tau.py` measures.
"""

from __future__ import annotations

import torch

from dflash_callbacks.cache.sampling import Sampling, served_logprobs
from dflash_callbacks.model import DFlashDrafter
from dflash_callbacks.model.geometry import anchor_range, block_inputs


@torch.no_grad()
def teacher_forced_taus(model, drafter: DFlashDrafter, task, sampling: Sampling, chunk: int = 64) -> torch.Tensor:
    """tau(a) (float64 [n_anchors]) at every anchor of one cache task (`CacheTask`), the target
    `model` a transformers causal LM on the task's device; the drafter reads the task's hidden states."""
    tempered = Sampling(sampling.temperature)
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    ids, B = task.input_ids, drafter.block_size
    p = served_logprobs(model(input_ids=ids[None]).logits[0], sampling).exp()  # p[i]: of token i + 1
    anchors = anchor_range(task.prompt_len, task.num_tokens)
    context = drafter.encode_context(task.hidden[: anchors[-1]][None].float(), torch.arange(anchors[-1])[None])
    taus = []
    for start in range(anchors.start, anchors.stop, chunk):
        span = torch.arange(start, min(start + chunk, anchors.stop))
        tokens, _, valid = block_inputs(ids, span, B, drafter.mask_token_id)
        C = int(span[-1])
        hidden = drafter.decode_blocks([(k[:, :, :C], v[:, :, :C]) for k, v in context], embed(tokens), span)
        q = served_logprobs(lm_head(hidden[:, 1:]), tempered).exp()  # [n, B-1, V]
        rows = (span[:, None] + torch.arange(B - 1)).clamp(max=ids.numel() - 2)  # p of the token at a + j: row a + j - 1
        accept = 1 - 0.5 * (p[rows] - q).abs().sum(dim=-1)
        accept = torch.where(valid, accept, 0).double()
        taus.append(1 + accept.cumprod(dim=1).sum(dim=1))
    return torch.cat(taus)


def teacher_forced_tau(model, drafter: DFlashDrafter, cache, sampling: Sampling) -> float:
    """The mean over `cache`'s tasks of each task's mean tau(a) over its anchors (the statistic of a
    report's `dense` mean, tau_probabilistic in place of the streak)."""
    drafter = drafter.eval()
    means = [float(teacher_forced_taus(model, drafter, cache.task(name), sampling).mean()) for name in cache.task_names]
    return sum(means) / len(means)
