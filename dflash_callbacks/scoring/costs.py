"""`Costs`: what one speculative-decoding round costs on a device, the JSON `scoring.costs` reads.

No torch here: a costs file is read and checked before anything loads. The format (docs/formats.md,
"Costs"), seconds everywhere, `B` a block size, `n` the tokens one verify forward takes, `L` a context length:

    format, version        "dflash-callbacks-costs", 1
    source                 who measured it: "profile" (`dflash-callbacks profile`) or e.g. "vllm step times"
    device, device_type    the device in words ("NVIDIA H200", "cpu (x86_64, 2 threads)") and its kind (cpu | cuda)
    dtype, batch_size      the dtype the models ran in, the requests decoded side by side
    library_version        dflash_callbacks' version that measured it (null: not measured by it)
    target                 {"hidden_size", "vocab_size", "num_layers"} of the target measured
    drafter                {"family", "hidden_size", "num_layers"} of the drafter measured (null: not said)
    contexts               the context lengths L measured, ascending
    verify                 {L: [T(1, L), T(2, L), ..., T(N, L)]}: the target's forward of n query tokens (with its
                           attention mask, the drafter's features and the LM head) after a KV cache of L tokens
    draft                  {B: T}: the drafter's round at block size B (its context update, block forward, head)
    selector               {B: T}: DFlash 2's candidate selector after the block forward (absent: none)
    overhead               {"chain": {B: T}, "tree": {B: {n: T}}}: the round's bookkeeping besides the forwards
                           (the drafts' argmax or the tree's construction, acceptance, the KV cache's update), or
                           one number for every round
    baseline_draft         {B: T}, optional: the baseline drafter's own round, where it differs in shape

`T_target(n, L)` between measured lengths is interpolated linearly, and held at the nearest end outside them.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..checks import DTYPE_NAMES, is_int

FORMAT = "dflash-callbacks-costs"
VERSION = 1
DEVICE_TYPES = ("cpu", "cuda")


class CostsError(ValueError):
    """A costs file that is not one, or that does not fit what it is used for; its message says why."""


def _bad(what: str) -> CostsError:
    return CostsError(f"not a costs file: {what}")


def _seconds(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise _bad(f"{where} is {value!r}, not a time in seconds (a finite number >= 0)")
    return float(value)


def _positive_key(key: Any, where: str, low: int = 1) -> int:
    if not isinstance(key, str) or not key.isdigit() or int(key) < low:
        raise _bad(f"{where} has the key {key!r}, not an integer >= {low} written as a string")
    return int(key)


def _times_by_block(raw: Any, where: str) -> dict[int, float]:
    if not isinstance(raw, dict):
        raise _bad(f"{where!r} is {raw!r}, not an object of block size -> seconds")
    return {_positive_key(k, where, 2): _seconds(v, f"{where}[{k!r}]") for k, v in raw.items()}


@dataclass(frozen=True)
class Costs:
    device: str
    device_type: str
    dtype: str
    batch_size: int
    target: dict[str, int]
    contexts: list[int]
    verify: dict[int, list[float]]  # L -> [T(1, L), ..., T(N, L)]
    draft: dict[int, float]
    overhead: dict[str, Any] | float
    selector: dict[int, float] = field(default_factory=dict)
    baseline_draft: dict[int, float] | None = None
    drafter: dict[str, Any] | None = None
    source: str = "profile"
    library_version: str | None = None
    created: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ reading and writing
    @classmethod
    def from_dict(cls, raw: Any) -> Costs:
        """A costs object from its JSON; CostsError naming the field for anything else."""
        if not isinstance(raw, dict):
            raise _bad(f"a JSON object was expected, found {type(raw).__name__}")
        if raw.get("format") != FORMAT:
            raise _bad(f"'format' is {raw.get('format')!r}, not {FORMAT!r}")
        if raw.get("version") != VERSION:
            raise _bad(f"'version' is {raw.get('version')!r}; this library reads version {VERSION}")
        required = ["device", "device_type", "dtype", "batch_size", "target", "contexts", "verify", "draft", "overhead"]
        missing = [k for k in required if k not in raw]
        if missing:
            raise _bad(f"it has no {', '.join(repr(k) for k in missing)}")
        for key in ("device", "source"):
            if not isinstance(raw.get(key, ""), str):
                raise _bad(f"{key!r} is {raw[key]!r}, not a string")
        if raw["device_type"] not in DEVICE_TYPES:
            raise _bad(f"'device_type' is {raw['device_type']!r}, not one of {list(DEVICE_TYPES)}")
        if raw["dtype"] not in DTYPE_NAMES:
            raise _bad(f"'dtype' is {raw['dtype']!r}, not one of {list(DTYPE_NAMES)}")
        if not is_int(raw["batch_size"]) or raw["batch_size"] < 1:
            raise _bad(f"'batch_size' is {raw['batch_size']!r}, not an integer >= 1")
        target = raw["target"]
        if not isinstance(target, dict) or sorted(target) != ["hidden_size", "num_layers", "vocab_size"] or not all(
                is_int(v) and v >= 1 for v in target.values()):
            raise _bad(f"'target' is {target!r}, not an object of 'hidden_size', 'vocab_size' and 'num_layers' "
                       "(integers >= 1)")
        drafter = raw.get("drafter")
        if drafter is not None and not isinstance(drafter, dict):
            raise _bad(f"'drafter' is {drafter!r}, not an object or null")
        contexts = raw["contexts"]
        if not isinstance(contexts, list) or not contexts or not all(is_int(c) and c >= 1 for c in contexts) \
                or contexts != sorted(set(contexts)):
            raise _bad(f"'contexts' is {contexts!r}, not a non-empty ascending list of distinct lengths >= 1")
        verify = raw["verify"]
        if not isinstance(verify, dict) or sorted(verify, key=lambda k: (len(k), k)) != [str(c) for c in contexts]:
            raise _bad(f"'verify' must hold one list of times per length of 'contexts' {contexts}; it holds "
                       f"{sorted(verify) if isinstance(verify, dict) else verify!r}")
        lengths = {len(v) if isinstance(v, list) else None for v in verify.values()}
        if len(lengths) != 1 or None in lengths or 0 in lengths:
            raise _bad("'verify' must hold, at every context length, the same non-empty list of times for n = 1, 2, ...")
        times = {int(L): [_seconds(t, f"verify[{L!r}][{i}] (n = {i + 1})") for i, t in enumerate(v)]
                 for L, v in verify.items()}
        draft = _times_by_block(raw["draft"], "draft")
        if not draft:
            raise _bad("'draft' holds no block size")
        selector = _times_by_block(raw.get("selector", {}), "selector")
        baseline = None if raw.get("baseline_draft") is None else _times_by_block(raw["baseline_draft"], "baseline_draft")
        overhead = _overhead(raw["overhead"])
        version = raw.get("library_version")
        if version is not None and not isinstance(version, str):
            raise _bad(f"'library_version' is {version!r}, not a string or null")
        created = raw.get("created")
        if created is not None:
            _seconds(created, "'created'")
        known = set(cls.__dataclass_fields__) | {"format", "version"}
        extra = {k: v for k, v in raw.items() if k not in known}
        return cls(device=raw["device"], device_type=raw["device_type"], dtype=raw["dtype"],
                   batch_size=int(raw["batch_size"]), target={k: int(v) for k, v in target.items()},
                   contexts=[int(c) for c in contexts], verify={L: times[L] for L in contexts}, draft=draft,
                   overhead=overhead, selector=selector, baseline_draft=baseline, drafter=drafter,
                   source=raw.get("source", "profile"), library_version=version, created=created,
                   extra={**raw.get("extra", {}), **{k: v for k, v in extra.items() if k != "extra"}})

    def to_dict(self) -> dict[str, Any]:
        out = {"format": FORMAT, "version": VERSION, **asdict(self)}
        out["verify"] = {str(L): list(times) for L, times in self.verify.items()}
        for key in ("draft", "selector"):
            out[key] = {str(b): t for b, t in out[key].items()}
        if self.baseline_draft is None:
            del out["baseline_draft"]
        else:
            out["baseline_draft"] = {str(b): t for b, t in self.baseline_draft.items()}
        if not isinstance(self.overhead, float):
            out["overhead"] = {"chain": {str(b): t for b, t in self.overhead["chain"].items()},
                               "tree": {str(b): {str(n): t for n, t in per.items()}
                                        for b, per in self.overhead["tree"].items()}}
        if not out["extra"]:
            del out["extra"]
        return out

    def to_json(self, path: str | Path | None = None) -> str:
        """The costs as JSON text; with `path`, also written there atomically."""
        from ..files import atomic_write

        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            atomic_write(path, (text + "\n").encode())
        return text

    @classmethod
    def load(cls, path: str | Path) -> Costs:
        path = Path(path)
        if not path.is_file():
            raise CostsError(f"no costs file at {path}: `dflash-callbacks profile --out {path}` measures one")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise CostsError(f"{path} is not JSON: {e}") from None
        except CostsError as e:
            raise CostsError(f"{path}: {e}") from None

    # ------------------------------------------------------------------ what a round costs
    @property
    def largest_n(self) -> int:
        """The most query tokens a verify forward was measured at."""
        return len(next(iter(self.verify.values())))

    def target_forward(self, n: int, context: float) -> float:
        """T_target(n, L): one forward of n query tokens after `context` tokens (interpolated between the
        measured lengths, held outside them)."""
        if not 1 <= n <= self.largest_n:
            raise CostsError(f"the costs hold verify forwards of 1 to {self.largest_n} tokens, not {n}: profile with "
                             f"a larger --ddtree-budgets, --topk or --block-sizes (verifying {n} tokens)")
        Ls = self.contexts
        if context <= Ls[0] or len(Ls) == 1:
            return self.verify[Ls[0]][n - 1]
        if context >= Ls[-1]:
            return self.verify[Ls[-1]][n - 1]
        hi = next(i for i, L in enumerate(Ls) if L >= context)
        L0, L1 = Ls[hi - 1], Ls[hi]
        w = (context - L0) / (L1 - L0)
        return (1 - w) * self.verify[L0][n - 1] + w * self.verify[L1][n - 1]

    def draft_round(self, block: int, baseline: bool = False) -> float:
        """T_draft(B): the drafter's round at block size B, DFlash 2's selector included (`baseline`: the
        baseline drafter's, where the costs hold its own, else the same)."""
        table = self.baseline_draft if baseline and self.baseline_draft is not None else self.draft
        if block not in table:
            whose = "the baseline's " if table is self.baseline_draft else ""
            raise CostsError(f"the costs hold {whose}drafter rounds at block sizes {sorted(table)}, not {block}: "
                             f"profile with --block-sizes {block}")
        return table[block] + (self.selector.get(block, 0.0) if table is self.draft else 0.0)

    def round_overhead(self, block: int, n: int, tree: bool) -> float:
        """The round's bookkeeping: a chain's at block B, or a tree's of n verified tokens at block B."""
        if isinstance(self.overhead, float):
            return self.overhead
        if not tree:
            if block not in self.overhead["chain"]:
                raise CostsError(f"the costs hold a chain's overhead at block sizes {sorted(self.overhead['chain'])}, "
                                 f"not {block}: profile with --block-sizes {block}")
            return self.overhead["chain"][block]
        per = self.overhead["tree"].get(block, {})
        if n not in per:
            raise CostsError(f"the costs hold no tree overhead for {n} verified tokens at block size {block} "
                             f"(they hold {sorted(per)}): profile with the budgets scored (--ddtree-budgets, --topk) "
                             f"and --block-sizes {block}")
        return per[n]

    # ------------------------------------------------------------------ whether it fits
    def mismatches(self, *, device_type: str | None = None, dtype: str | None = None,
                   target: dict[str, int] | None = None, drafter: dict[str, Any] | None = None) -> list[str]:
        """One line per way these costs do not describe what they are used for: another kind of device,
        another dtype, another target shape, another drafter shape (each check only where it is given)."""
        lines = []
        if device_type is not None and device_type != self.device_type:
            lines.append(f"measured on {self.device} ({self.device_type}), scored for {device_type}")
        if dtype is not None and dtype != self.dtype:
            lines.append(f"measured in {self.dtype}, scored in {dtype}")
        for whose, mine, theirs in (("target", self.target, target), ("drafter", self.drafter, drafter)):
            if mine is None or theirs is None:
                continue
            differ = [f"{k} {mine[k]} (measured) vs {theirs[k]}" for k in sorted(theirs)
                      if k in mine and mine[k] != theirs[k]]
            if differ:
                lines.append(f"another {whose} shape: {', '.join(differ)}")
        return lines


def _overhead(raw: Any) -> dict[str, Any] | float:
    if not isinstance(raw, dict):
        return _seconds(raw, "'overhead'")
    if sorted(raw) != ["chain", "tree"]:
        raise _bad(f"'overhead' is an object of {sorted(raw)}, not of 'chain' and 'tree' (or one number)")
    chain = _times_by_block(raw["chain"], "overhead.chain")
    if not isinstance(raw["tree"], dict):
        raise _bad("'overhead.tree' is not an object of block size -> {verified tokens -> seconds}")
    tree = {}
    for block, per in raw["tree"].items():
        b = _positive_key(block, "overhead.tree", 2)
        if not isinstance(per, dict):
            raise _bad(f"'overhead.tree[{block!r}]' is not an object of verified tokens -> seconds")
        tree[b] = {_positive_key(n, f"overhead.tree[{block!r}]", 2): _seconds(t, f"overhead.tree[{block!r}][{n!r}]")
                   for n, t in per.items()}
    return {"chain": chain, "tree": tree}


def check_costs_fit(costs: Costs, force: bool, **used) -> list[str]:
    """The mismatches of `costs` with what they are used for (`Costs.mismatches`' keywords), as a refusal:
    CostsError with one line naming them, unless `force`, when they come back as warnings."""
    lines = costs.mismatches(**used)
    if lines and not force:
        raise CostsError(f"the costs file does not fit: {'; '.join(lines)} (scoring.force_costs=true uses it anyway)")
    return lines
