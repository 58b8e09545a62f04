"""JetSpec (hao-ai-lab/JetSpec; its trainer in NeMo Automodel): the DFlash v1 drafter, the same weights
and tensor names, trained **block-causal**: block offset i attends to offsets j <= i (and the whole
context before the anchor), every layer.

Block: DFlash's (row 0 the anchor, row i >= 1 drafts the token at a + i). Every row after the anchor
holds MASK, so each slot's distribution does not depend on the tokens drafted before it: vanilla is the
per-slot argmax run, and DDTree's closed form is exact. Serving drafts one block pass: the chain
proposes each slot's argmax; JetSpec's tree drafter (`accum_logp`) puts each depth's top-W tokens
under every parent, best-first on the cumulative log-prob (`accum_logp_tree`, `tree_accepted`).

Configs (docs/formats.md), one set of tensors in two layouts:
- Automodel's consolidated export (`architectures: ["Qwen3DFlashDraftModel"]`, shards and their
  index): `dflash_config.causal: true`, and a top-level `is_causal: false` the recipe stamps on every
  drafter it trains;
- the JetSpec reference's (and its published heads'): `dflash_config.causal_head: true`, whatever the
  architecture (`families` identifies it by that mark).
Causality is spelled three ways, and the readers disagree (`attention_note`): the trainer meant
block-causal; vLLM reads the top-level `is_causal` first, then `dflash_config.causal`, never
`causal_head` (docs/numbers.md cites the code), so it serves Automodel's checkpoint as saved
bidirectional in every layer; the reference reads `causal_head` alone (absent: bidirectional). The
"trained" attention rule is JetSpec's pattern, "vllm" (and "auto") what vLLM resolves.

Automodel writes `Qwen3DFlashDraftModel` for its DFlash and Domino drafters too; a config of that
architecture without JetSpec's `causal` is refused in one line (it is not a JetSpec drafter).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..attention import LayerAttention, resolve_attention
from ..drafter import DFlashDrafter

AUTOMODEL_ARCHITECTURE = "Qwen3DFlashDraftModel"


@dataclass(frozen=True)
class Settings:
    """The spellings of causality a JetSpec config carries beside the backbone's `is_causal` (what its
    trainer meant: true, wherever it is said)."""

    causal: bool | None = True  # dflash_config.causal (Automodel's JetSpec recipe); vLLM reads it after is_causal
    causal_head: bool | None = None  # dflash_config.causal_head (the JetSpec reference, the published heads)

    def __post_init__(self) -> None:
        problems = [f"field 'dflash_config.{name}' must be true, false or null; got {value!r}"
                    for name, value in (("causal", self.causal), ("causal_head", self.causal_head))
                    if value is not None and not isinstance(value, bool)]
        if not problems and True not in (self.causal, self.causal_head):
            problems.append(f"neither dflash_config.causal nor dflash_config.causal_head is true (causal "
                            f"{self.causal!r}, causal_head {self.causal_head!r}): a JetSpec drafter is trained "
                            "block-causal and its config says so in one of them; NeMo Automodel also writes "
                            f"{AUTOMODEL_ARCHITECTURE} for its DFlash and Domino drafters, which this library does "
                            "not read in that layout")
        elif not problems and False in (self.causal, self.causal_head):
            problems.append(f"dflash_config.causal is {self.causal!r} but dflash_config.causal_head is "
                            f"{self.causal_head!r}: the config contradicts itself on the pattern it was trained under")
        if problems:
            raise ValueError("; ".join(problems))


def read_config(raw: dict[str, Any]) -> tuple[dict[str, Any], Settings]:
    """The backbone in the published layout and the spellings of causality: `dflash_config.causal` is read
    and left in place (the backbone reads it too, after `is_causal`, as vLLM does), `causal_head` taken out."""
    dflash = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    return raw, Settings(causal=dflash.get("causal"), causal_head=dflash.pop("causal_head", None))


def write_config(settings: Settings, out: dict[str, Any]) -> None:
    """Each spelling the config carried, back in `dflash_config` (`is_causal` is the backbone's)."""
    for name in ("causal", "causal_head"):
        if getattr(settings, name) is not None:
            out["dflash_config"][name] = getattr(settings, name)


def check_config(config) -> None:
    """What a JetSpec drafter of `config` needs of the backbone, every problem at once."""
    settings, problems = config.family_config, []
    if "sliding_attention" in config.layer_types:
        problems.append("layer_types has sliding_attention layers: a JetSpec drafter with a sliding window is not "
                        "scored here (no trainer's mask for it was checked); full_attention layers only")
    read_back = config.is_causal if config.is_causal is not None else settings.causal
    if config.causal != read_back:
        problems.append(f"the config's causal is {config.causal!r} but its is_causal ({config.is_causal!r}) and "
                        f"dflash_config.causal ({settings.causal!r}) read back as {read_back!r}: set causal to is_causal, "
                        "or without is_causal to dflash_config.causal (vLLM reads them in that order), so that a copy "
                        "written to config.json is read as this drafter")
    if problems:
        raise ValueError("\n".join(problems))


class Drafter(DFlashDrafter):
    """A JetSpec drafter: DFlash's tensors and block; its trained pattern is `trained_attention`."""

    family = "jetspec"

    def __init__(self, config):
        if config.family == self.family:
            check_config(config)
        super().__init__(config)


def trained_attention(config) -> list[LayerAttention]:
    """Every layer causal in the block (offset i sees offsets j <= i), as Automodel's trainer and the
    reference's `causal_head` run it."""
    return [LayerAttention(causal=True) for _ in config.layer_types]


def attention_note(config, rules: list[str]) -> str | None:
    """One line when vLLM will serve the checkpoint as saved otherwise than its trainer meant: the spellings
    it carries, what each reader makes of them, the rule that scores each, and the setting that scores both
    when `rules` (the run's attention and attentions) lack one. None when vLLM serves it block-causal."""
    served = resolve_attention(config, "vllm")
    if all(layer.causal for layer in served):
        return None
    settings: Settings = config.family_config
    said = [f"{name} {str(value).lower()}" for name, value in (
        ("is_causal", config.is_causal), ("dflash_config.causal", settings.causal),
        ("dflash_config.causal_head", settings.causal_head)) if value is not None]
    why = ("it reads the top-level is_causal first" if config.is_causal is not None else
           "it reads is_causal and dflash_config.causal, never causal_head")
    reference = "" if settings.causal_head else "; the JetSpec reference, reading only causal_head, runs it " \
                                                "bidirectional too"
    missing = [rule for rule, alike in (("trained", {"trained"}), ("vllm", {"vllm", "auto"})) if not alike & set(rules)]
    both = "" if not missing else f"; scoring.attentions={missing} scores both"
    return (f"JetSpec attention: the checkpoint says {', '.join(said)}; its trainer meant every layer block-causal "
            f"(attention='trained' scores that), vLLM will serve every layer bidirectional ({why}; "
            f"attention='vllm' scores that, as does the default 'auto'){reference}{both}")


# ---------------------------------------------------------------- the accum_logp tree


class Tree(NamedTuple):
    """A draft tree in breadth-first insertion order; node 0 is the anchor (parent -1, depth 0)."""

    choice: list[int]  # the node's index among its depth's top-W (-1: the anchor)
    parents: list[int]
    depth: list[int]
    cum_logprob: list[float]


def accum_logp_tree(top_logprobs: torch.Tensor, budget: int) -> Tree:
    """JetSpec's `accum_logp` tree of a block whose depth d (1 .. D) has the log-probs `top_logprobs[d-1]`
    [D, W] (its top-W tokens, best first): from the anchor, repeatedly take the node of the highest
    cumulative log-prob not yet expanded (the earliest added on ties) and, below depth D, give it its next
    depth's W tokens as children (fewer where `budget` nodes, the anchor counted, are reached). The same W
    tokens sit under every parent of a depth: each slot's distribution ignores the tokens before it."""
    depths, width = top_logprobs.shape
    values = top_logprobs.double().tolist()
    tree = Tree([-1], [-1], [0], [0.0])
    frontier = [(-0.0, 0)]  # (-cumulative log-prob, node): heapq pops the largest log-prob, then the earliest node
    while frontier and len(tree.parents) < budget:
        _, node = heapq.heappop(frontier)
        d = tree.depth[node]
        if d == depths:
            continue
        for j in range(min(width, budget - len(tree.parents))):
            child = len(tree.parents)
            tree.choice.append(j)
            tree.parents.append(node)
            tree.depth.append(d + 1)
            tree.cum_logprob.append(tree.cum_logprob[node] + values[d][j])
            heapq.heappush(frontier, (-tree.cum_logprob[child], child))
    return tree


def tree_accepted(tree: Tree, label_choice: list[int]) -> int:
    """How many tokens a verifier accepts of `tree` along the true text: the longest run of depths whose
    true token (its index among that depth's top-W in `label_choice`, -1 when it is not among them) is a
    child of the node accepted before it."""
    node, accepted = 0, 0
    for choice in label_choice:
        child = next((c for c in range(len(tree.parents)) if tree.parents[c] == node and tree.choice[c] == choice), None)
        if choice < 0 or child is None:
            break
        node, accepted = child, accepted + 1
    return accepted
