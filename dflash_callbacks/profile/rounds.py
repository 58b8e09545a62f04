"""The pieces of one speculative-decoding round, as the timed decoder runs them and as the profile times them.

Greedy decoding with a KV cache, batch 1 (the profile times the forwards at any batch size):

- `Speculator.draft`: the drafter's round: its context keys and values grow by the tokens the last round
  committed (their target features projected, `encode_context`), then the block [anchor, MASK x (B-1)] is
  decoded against them (`decode_blocks`) and its draft slots scored by the head: log-probs [P, V] (DFlash 2:
  its selector's walk instead, `draft_selector`).
- `chain` or `tree`: the tokens to verify: the argmax of each slot (a chain of B - 1 drafts after the anchor),
  or DDTree's tree of N nodes (Algorithm 1: the N best prefixes by summed log-prob over the top N of each depth).
- `Speculator.verify`: the target's one forward over the anchor and the drafts, after the KV cache, each one
  attending to the cache and to its own ancestors (a 4-D mask, each layer's sliding window applied): the
  target's next token after each, and its features for the drafter.
- `accept` and `Speculator.commit`: walk the tree along the target's own tokens (the accepted drafts, then its
  bonus token) and keep in the KV cache the anchor and the accepted drafts only.

Plain decoding is `verify` of one token and its argmax.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..cache.extract import cache_argument


@dataclass
class Proposal:
    """What a round verifies: tokens[0] is the anchor, tokens[i] (i >= 1) a draft whose parent is
    parents[i] (an index into tokens; parents[0] = -1) at depth depths[i] (the anchor at 0)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]


def chain(anchor: int, logprobs: torch.Tensor) -> Proposal:
    """The argmax of each draft slot of `logprobs` [P, V]: a chain of P drafts after the anchor."""
    drafts = logprobs.argmax(dim=-1).tolist()
    P = len(drafts)
    return Proposal([anchor, *drafts], list(range(-1, P)), list(range(P + 1)))


def tree(anchor: int, logprobs: torch.Tensor, budget: int) -> Proposal:
    """DDTree Algorithm 1: the `budget` best prefixes (the sum of per-depth log-probs, float64; ties to the
    smaller rank tuple) over the top min(budget, V) tokens of each depth of `logprobs` [P, V], as a tree below
    the anchor, each node after its parent."""
    values, ids = logprobs.double().topk(min(budget, logprobs.shape[-1]), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    heap = [(-values[0][0], (0,))]
    tokens, parents, depths = [anchor], [-1], [0]
    index = {(): 0}  # rank tuple -> node index
    while heap and len(tokens) <= budget:
        neg, ranks = heapq.heappop(heap)
        depth, r = len(ranks), ranks[-1]
        index[ranks] = len(tokens)
        tokens.append(ids[depth - 1][r])
        parents.append(index[ranks[:-1]])
        depths.append(depth)
        if r + 1 < len(values[0]):  # the sibling of the next rank
            heapq.heappush(heap, (neg + values[depth - 1][r] - values[depth - 1][r + 1], ranks[:-1] + (r + 1,)))
        if depth < len(values):  # the best child
            heapq.heappush(heap, (neg - values[depth][0], ranks + (0,)))
    return Proposal(tokens, parents, depths)


def accept(proposal: Proposal, target_tokens: list[int]) -> tuple[list[int], int]:
    """(the indices of the accepted drafts, root first excluded, the bonus token): from the anchor, step to the
    child holding the target's next token while there is one; the bonus is the target's token after the last."""
    children = {(p, t): i for i, (p, t) in enumerate(zip(proposal.parents, proposal.tokens)) if i}
    path, at = [], 0
    while (at := children.get((at, target_tokens[at]), -1)) != -1:
        path.append(at)
    return path, target_tokens[path[-1] if path else 0]


class Speculator:
    """The target `model` (a transformers causal LM) and a block drafter, for greedy speculative decoding."""

    def __init__(self, model, drafter):
        self.model, self.drafter = model, drafter
        self.cache_arg = cache_argument(model)
        config = model.config.get_text_config()
        self.layer_types = sorted(set(getattr(config, "layer_types", None) or ["full_attention"]))
        self.window = getattr(config, "sliding_window", None)
        self.embed = model.get_input_embeddings()
        self.head = drafter.head_weight(model.get_output_embeddings().weight)
        self.layer_ids = list(drafter.config.target_layer_ids)
        self.device = self.head.device

    # ------------------------------------------------------------------ the target
    def masks(self, past: int, positions: torch.Tensor, parents: list[int], batch: int = 1) -> dict:
        """Per layer type, the boolean mask [batch, 1, n, past + n] (True: attend): every query sees the
        `past` cached positions and its own ancestors and itself, a sliding layer only keys within its window."""
        n = len(parents)
        ancestors = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(parents):
            ancestors[i, i] = True
            if p >= 0:
                ancestors[i] |= ancestors[p]
        ancestors = ancestors.to(self.device)
        seen = torch.cat([torch.ones(n, past, dtype=torch.bool, device=self.device), ancestors], dim=1)
        keys = torch.cat([torch.arange(past, device=self.device), positions])
        out = {}
        for kind in self.layer_types:
            mask = seen
            if kind == "sliding_attention" and self.window is not None:
                mask = seen & (positions[:, None] - keys[None, :] < self.window)
            out[kind] = mask[None, None].expand(batch, 1, n, past + n)
        return out

    def verify(self, kv: DynamicCache, tokens: torch.Tensor, depths: list[int], parents: list[int]):
        """One target forward of `tokens` [batch, n] after the `kv` cache, at positions past + depth, each
        seeing the cache and its ancestors: (the greedy next token after each [batch, n], the drafter's
        features of each [batch, n, F])."""
        past = kv.get_seq_length()
        positions = past + torch.tensor(depths, device=self.device)
        out = self.model(input_ids=tokens, position_ids=positions[None].expand(tokens.shape[0], -1),
                         attention_mask=self.masks(past, positions, parents, tokens.shape[0]),
                         output_hidden_states=True, use_cache=True, **{self.cache_arg: kv})
        features = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)
        return out.logits.argmax(dim=-1), features

    @staticmethod
    def commit(kv: DynamicCache, past: int, kept: list[int]) -> None:
        """Keep in `kv` its first `past` positions and, of the round's after them, those at indices `kept`
        (the anchor and the accepted drafts: a prefix is cut, a branch gathered)."""
        if kept == list(range(len(kept))):
            extra = kv.get_seq_length() - past - len(kept)
            if extra > 0:
                kv.crop(-extra)
            return
        index = torch.tensor(list(range(past)) + [past + i for i in kept], device=kv.layers[0].keys.device)
        for layer in kv.layers:
            layer.keys, layer.values = layer.keys[:, :, index], layer.values[:, :, index]

    # ------------------------------------------------------------------ the drafter
    def draft(self, context: list | None, new_features: torch.Tensor, start: int, anchor_tokens: torch.Tensor,
              anchors: torch.Tensor, block: int) -> tuple[list, torch.Tensor]:
        """The drafter's round: its per-layer context keys and values (`context`, None: none yet) grown by the
        features [batch, m, F] of positions start .. start + m - 1, then the blocks of `block` at `anchors`
        [batch] (each seeing the context before it), each [its anchor token, MASK x (block - 1)]: (the grown
        context, the draft slots' hidden [batch, P, H'])."""
        d = self.drafter
        batch, m = new_features.shape[:2]
        if m or context is None:
            positions = torch.arange(start, start + m, device=self.device)[None]
            new = d.encode_context(new_features.to(d.input_weight.dtype), positions)
            context = new if context is None else [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                                                   for (k0, v0), (k1, v1) in zip(context, new)]
        ids = torch.full((batch, block), d.mask_token_id, device=self.device)
        ids[:, 0] = anchor_tokens
        hidden = d.decode_blocks(context, self.embed(ids).to(d.input_weight.dtype), anchors)
        previous = ids[:, :1].expand(batch, len(d.draft_rows(block)))
        return context, d.slot_features(hidden, previous, self.embed)

    def logprobs(self, features: torch.Tensor) -> torch.Tensor:
        """The drafter's log-probs [..., P, V] of the draft slots' `features` [..., P, H'] (over the target's
        vocabulary ids where the drafter drafts a pruned one: the others at -inf)."""
        logits = (features @ self.head.T.to(features.dtype)).float()
        ids = self.drafter.vocab_ids
        if ids is not None:
            full = torch.full((*logits.shape[:-1], self.embed.weight.shape[0]), float("-inf"), device=logits.device)
            full[..., ids.to(logits.device)] = logits
            logits = full
        return torch.log_softmax(logits, dim=-1)

    def selector(self, features: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """DFlash 2: its candidate selector's greedy walk over the block's slots [batch, P] (`greedy_walk`)."""
        from ..model.families.dflash2_selector import greedy_walk

        batch, P = features.shape[:2]
        labels = torch.zeros(batch, P, dtype=torch.long, device=self.device)
        stats = self.drafter.slot_stats(features, self.head, labels, anchor[:, None].expand(batch, P), 0)
        return greedy_walk(stats, batch)
