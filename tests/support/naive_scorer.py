"""The naive scorer: one drafter forward per anchor, full logits, `oracles.streaks`.

Slow and memory-hungry on purpose: it is the plain definition the batched scorer
(`scorer.score_task`) is tested and benchmarked against. Each layer attends as
`config.attention` resolves for the drafter; a pruned draft vocabulary gets -inf logits
off its target ids (what vLLM's DFlash `compute_logits` returns), and a label off it ends
the streak.
"""

from __future__ import annotations

import torch

from oracles import streaks

from dflash_callbacks.model.attention import resolve_attention
from dflash_callbacks.model.geometry import anchor_range, block_inputs
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.scoring.scorer import TaskStreaks


@torch.no_grad()
def score_task_naive(drafter, head, task, config: ScoringConfig, block_size: int) -> TaskStreaks:
    device, dtype = drafter.input_weight.device, drafter.input_weight.dtype
    anchors = anchor_range(task.prompt_len, task.num_tokens, config.window)
    input_ids = task.input_ids.to(device)
    attention = resolve_attention(drafter.config, config.attention)
    vocab_ids = drafter.vocab_ids
    parts: dict[str, list[torch.Tensor]] = {}
    for a in anchors:
        tokens, labels, valid = block_inputs(input_ids, torch.tensor([a], device=device), block_size, drafter.mask_token_id)
        hidden = drafter(
            task.hidden[:a].to(device=device, dtype=dtype)[None],
            head.embed_tokens(tokens).to(dtype),
            torch.arange(a + block_size, device=device)[None],
            attention=attention,
        )
        logits = head.lm_head(hidden[:, 1:]).float()  # [1, B-1, V]
        if vocab_ids is not None:
            drafted = torch.zeros(logits.shape[-1], dtype=torch.bool, device=device)
            drafted[vocab_ids] = True
            logits = logits.masked_fill(~drafted, float("-inf"))
            valid = valid & drafted[labels]
        result = streaks(logits, labels, ddtree_budgets=config.ddtree_budgets, topk=config.topk, valid=valid)
        for method, value in result.items():
            parts.setdefault(method, []).append(value.cpu())
    return TaskStreaks(task.name, anchors[0], {m: torch.cat(v) for m, v in parts.items()})
