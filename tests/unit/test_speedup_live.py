"""The predicted speed-up holds against real speculative decoding, timed: on the toy world on this CPU, the toy
baseline decodes three cached prompts with vanilla and ddtree@4 at block 8, beside plain greedy decoding, with
the real toy target and a real KV cache; the speed-up measured (plain seconds / speculative seconds) is the one
predicted from a profile taken in the same run, within generous bounds (a ratio, not a time), both counted in
this thread's CPU seconds (the machine is shared: its other processes' time is not the decoder's; the wall-clock
comparison is `benchmarks/bench_speedup.py`'s). The decoded text is plain greedy decoding's (`check_speedups` refuses another), and each round's tau
is the report's: the decoder is the scorer's live schedule, run."""

import pytest
import torch

from dflash_callbacks import load_drafter
from dflash_callbacks.demos.toy.threads import torch_threads
from dflash_callbacks.demos.toy.world import toy_baseline_path
from dflash_callbacks.profile.validate import check_speedups


def test_the_measured_speedup_is_the_predicted_one(toy_cache, toy_target):
    drafter = load_drafter(toy_baseline_path(), dtype=torch.float32)
    with torch_threads(1):
        rows, costs, report = check_speedups(toy_target, drafter, toy_cache, ddtree_budgets=[4], block_sizes=[8],
                                             tasks=toy_cache.task_names[:3], passes=2, repeats=5,
                                             clock="cpu")
    assert [r.method for r in rows] == ["vanilla:b8", "ddtree@4:b8"]
    for row in rows:
        assert row.tau_decoded == pytest.approx(row.tau_report, rel=0.05)  # the same rounds, the text's last aside
        assert 0.6 < row.ratio < 1.6, row
    assert costs.device_type == "cpu" and costs.largest_n == 8 and costs.extra["clock"] == "cpu"
