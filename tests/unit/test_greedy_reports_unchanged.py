"""At T = 0 every report is as it was before scoring learnt temperatures, bit for bit: the reports of every
family (DFlash full and sliding, DFlash 2, DSpark, Domino) on a greedy cache of the fixtures' text and of
copies holding each family's greedy draft (so that streaks reach into the block), at two block sizes, hold the numbers a checkout from before served scoring wrote (tests/fixtures/served/
greedy_reports.json, written by `write_golden` below run against that checkout): every aggregate, curve,
live round, streak, interval, mean, the family and the attention recorded.

Updated once since, by scorer version 6 (`write_golden` run against this checkout): every task and method
gained `pooled` and `rounds` (and the run-level `mean` and `intervals` their `pooled`); each method's
intervals are now its own resampling (they equal what the code of before gave a report of that method alone,
checked when the file was rewritten), where every method of a report was resampled alike; `scorer_version` 6.
Every other number (dense, live, curve, live rounds, streaks, means) is as it was.

The fields the served scoring added to a report (`scoring`'s new settings, `attention_patterns` where the
trained and served patterns differ) are not numbers and are left out of the comparison; a greedy report has
no `cache.sampling` and no `expected` anywhere."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash_callbacks import load_drafter
from dflash_callbacks.cache.format import HiddenStateCache, TargetInfo, new_manifest, open_for_writing, write_task
from dflash_callbacks.model import TargetHead
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.scoring.scorer import score_drafter

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GOLDEN = FIXTURES / "served" / "greedy_reports.json"
DRAFTERS = {
    "dflash-full": FIXTURES / "trainers" / "speculators-full" / "checkpoint",
    "dflash-sliding": FIXTURES / "trainers" / "speculators-sliding-causal" / "checkpoint",
    "dflash2": FIXTURES / "families" / "dflash2-full" / "checkpoint",
    "dspark": FIXTURES / "families" / "dspark" / "checkpoint",
    "domino": FIXTURES / "families" / "domino" / "checkpoint",
}
KEPT = ("tasks", "mean", "intervals", "family", "attention", "block_size", "drafter_block_size", "scorer_version")


def greedy_paths() -> dict[str, torch.Tensor]:
    """Each family's greedy draft at the fixtures' anchors (3, 8, 11, 14): [4, P] tokens a+1 .. a+P, as its
    upstream code drafted it: a text holding one is accepted far into the block, so the streaks are not all 0."""
    def load(case: str) -> dict:
        return load_file(str(FIXTURES / case / "expected.safetensors"))

    return {"dflash-full": load("trainers/speculators-full")["logits"][:, 1:].argmax(-1),
            "dflash-sliding": load("trainers/speculators-sliding-causal")["logits"][:, 1:].argmax(-1),
            "dflash2": load("families/dflash2-full")["serve_greedy_tokens"],
            "dspark": load("families/dspark")["greedy_tokens"],
            "domino": load("families/domino")["spec_greedy_tokens"]}


def greedy_cache(root: Path) -> tuple[TargetHead, HiddenStateCache]:
    """The fixtures' target head and a greedy cache of their 20-token text (prompt 3) and, per family and anchor,
    a copy that holds the family's greedy draft there (anchors 3 and 11)."""
    inputs = load_file(str(FIXTURES / "families" / "dflash2-full" / "inputs.safetensors"))
    target, cache = root / "target", root / "cache"
    target.mkdir(parents=True, exist_ok=True)
    save_file({"model.embed_tokens.weight": inputs["target_embed_tokens"].contiguous(),
               "lm_head.weight": inputs["target_lm_head"].contiguous()}, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 97, "hidden_size": 64}))
    open_for_writing(cache, new_manifest(TargetInfo(str(target), 8, 64, 97, "float32"), [1, 3, 5]))
    tokens = inputs["context_input_ids"]
    write_task(cache, "text", tokens, inputs["target_hidden"], 3)
    for family, paths in greedy_paths().items():
        for a, path in list(zip(inputs["anchors"].tolist(), paths))[::2]:  # anchors 3 and 11: a small golden file
            walked = tokens.clone()
            walked[a + 1 : a + 1 + len(path)] = path
            write_task(cache, f"{family}-a{a}", walked, inputs["target_hidden"], 3)
    return TargetHead.from_pretrained(target), HiddenStateCache(cache)


def greedy_reports(root: Path) -> dict[str, dict]:
    """Each drafter's report on the greedy cache, its numbers only (`KEPT`)."""
    head, cache = greedy_cache(root)
    out = {}
    for name, path in DRAFTERS.items():
        trees = [] if name in ("dspark", "domino") else [2, 4]  # their slots read the token before: no DDTree
        config = ScoringConfig(ddtree_budgets=trees, topk=[2], block_sizes=[3], max_rounds=6, device="cpu")
        report = json.loads(score_drafter(load_drafter(path), cache, head, config).to_json())
        out[name] = {key: report[key] for key in KEPT}
    return out


def test_greedy_reports_are_bit_for_bit_as_before(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    found = greedy_reports(tmp_path)
    assert sorted(found) == sorted(golden)
    for name in golden:
        for key in KEPT:
            assert found[name][key] == golden[name][key], f"{name}: {key} differs from the report before"
        for entry in found[name]["tasks"].values():
            assert not any("expected" in numbers for numbers in entry.values())


def write_golden(root: Path) -> None:
    """Run as `PYTHONPATH=CHECKOUT python tests/unit/test_greedy_reports_unchanged.py DIR`, CHECKOUT a checkout
    from before served scoring (main at f7ea126), DIR a scratch folder."""
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    reports = greedy_reports(root)
    GOLDEN.write_text("{\n" + ",\n".join(f"{json.dumps(name)}: {json.dumps(reports[name], separators=(',', ':'))}"
                                          for name in sorted(reports)) + "\n}\n")


if __name__ == "__main__":
    write_golden(Path(sys.argv[1]))
