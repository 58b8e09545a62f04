"""The costs file: a profile of the toy world written and read back as it was, every damaged field refused
naming it, and a file measured for another device, dtype or shape refused in one line unless forced."""

import json

import pytest
import torch

from dflash_callbacks import load_drafter
from dflash_callbacks.cache.extract import load_target
from dflash_callbacks.demos.toy.world import toy_baseline_path, toy_target_path
from dflash_callbacks.scoring.costs import Costs, CostsError, check_costs_fit
from dflash_callbacks.profile.timing import profile_costs


@pytest.fixture(scope="module")
def profiled():
    model, _ = load_target(toy_target_path(), dtype=torch.float32)
    drafter = load_drafter(toy_baseline_path(), dtype=torch.float32)
    return profile_costs(model, drafter, block_sizes=[8, 4], ddtree_budgets=[4], topk=[2], contexts=[16, 48],
                         repeats=2, warmup=0, baseline=drafter)


def test_a_profile_round_trips_through_its_json(profiled, tmp_path):
    path = tmp_path / "costs.json"
    profiled.to_json(path)
    back = Costs.load(path)
    assert back == profiled
    raw = json.loads(path.read_text())
    assert raw["format"] == "dflash-callbacks-costs" and raw["version"] == 1
    assert raw["device_type"] == "cpu" and raw["dtype"] == "float32" and raw["batch_size"] == 1
    assert raw["library_version"] == "0.1.0"
    assert raw["target"] == {"hidden_size": 128, "vocab_size": 260, "num_layers": 4}
    # every n a scored method verifies: block 8's chain (8), ddtree@4 (5), top@2 at block 8 (2 x 7 + 1)
    assert back.largest_n == 15 and len(raw["verify"]["16"]) == 15
    assert sorted(back.overhead["tree"][8]) == [5, 15] and sorted(back.overhead["tree"][4]) == [5, 7]
    assert sorted(back.draft) == [4, 8] and sorted(back.baseline_draft) == [4, 8]
    assert all(t > 0 for per in back.verify.values() for t in per)


def test_the_target_forward_is_interpolated_between_contexts_and_held_outside(profiled):
    lo, hi = profiled.verify[16][2], profiled.verify[48][2]
    assert profiled.target_forward(3, 32) == pytest.approx((lo + hi) / 2)
    assert profiled.target_forward(3, 1) == lo and profiled.target_forward(3, 10_000) == hi
    with pytest.raises(CostsError, match="1 to 15 tokens, not 16"):
        profiled.target_forward(16, 32)
    with pytest.raises(CostsError, match="block sizes \\[4, 8\\], not 16: profile with --block-sizes 16"):
        profiled.draft_round(16)


def damaged(profiled, change):
    raw = profiled.to_dict()
    change(raw)
    return raw


@pytest.mark.parametrize("change, says", [
    (lambda r: r.update(format="other"), "'format' is 'other'"),
    (lambda r: r.update(version=2), "this library reads version 1"),
    (lambda r: r.pop("verify"), "it has no 'verify'"),
    (lambda r: r.update(device_type="tpu"), "'device_type' is 'tpu', not one of ['cpu', 'cuda']"),
    (lambda r: r.update(dtype="float64"), "'dtype' is 'float64'"),
    (lambda r: r.update(batch_size=0), "'batch_size' is 0"),
    (lambda r: r["target"].pop("vocab_size"), "'target' is"),
    (lambda r: r.update(contexts=[48, 16]), "ascending"),
    (lambda r: r["verify"]["16"].pop(), "the same non-empty list of times"),
    (lambda r: r["verify"]["16"].__setitem__(0, -1.0), "verify['16'][0] (n = 1) is -1.0, not a time"),
    (lambda r: r["draft"].update({"x": 0.1}), "draft has the key 'x'"),
    (lambda r: r["overhead"].pop("tree"), "'overhead' is an object of ['chain']"),
    (lambda r: r.update(overhead="fast"), "'overhead' is 'fast', not a time"),
])
def test_a_damaged_costs_file_is_refused_naming_the_field(profiled, change, says):
    with pytest.raises(CostsError) as raised:
        Costs.from_dict(damaged(profiled, change))
    assert str(raised.value).startswith("not a costs file: ") and says in str(raised.value)


def test_one_overhead_for_every_round_is_a_costs_file_too(profiled):
    costs = Costs.from_dict(damaged(profiled, lambda r: r.update(overhead=0.001)))
    assert costs.round_overhead(8, 9, tree=True) == costs.round_overhead(4, 4, tree=False) == 0.001


def test_a_costs_file_of_another_device_dtype_or_shape_is_refused_in_one_line_unless_forced(profiled):
    target = {"hidden_size": 5120, "vocab_size": 260, "num_layers": 4}
    with pytest.raises(CostsError) as raised:
        check_costs_fit(profiled, False, device_type="cuda", dtype="bfloat16", target=target)
    line = str(raised.value)
    assert "\n" not in line
    assert "measured on cpu" in line and "scored for cuda" in line
    assert "measured in float32, scored in bfloat16" in line
    assert "another target shape: hidden_size 128 (measured) vs 5120" in line
    assert "scoring.force_costs=true" in line
    assert len(check_costs_fit(profiled, True, device_type="cuda", dtype="bfloat16", target=target)) == 3
    assert check_costs_fit(profiled, False, device_type="cpu", dtype="float32",
                           target={"hidden_size": 128, "vocab_size": 260, "num_layers": 4},
                           drafter={"family": "dflash", "hidden_size": 128, "num_layers": 2}) == []
    with pytest.raises(CostsError, match=r"another drafter shape: family dflash \(measured\) vs dflash2, num_layers 2 "
                                         r"\(measured\) vs 5 \("):
        check_costs_fit(profiled, False, drafter={"family": "dflash2", "hidden_size": 128, "num_layers": 5})


def test_a_missing_or_foreign_file_says_what_it_is(tmp_path):
    with pytest.raises(CostsError, match="no costs file at .*dflash-callbacks profile --out"):
        Costs.load(tmp_path / "none.json")
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(CostsError, match="is not JSON"):
        Costs.load(tmp_path / "x.json")


def test_the_profile_command_writes_a_costs_file_and_refuses_mistakes_in_one_line_each(tmp_path, capsys):
    from dflash_callbacks.cli import main as cli_main

    target, drafter, out = str(toy_target_path()), str(toy_baseline_path()), tmp_path / "costs.json"
    argv = ["profile", "--target", target, "--drafter", drafter, "--device", "cpu", "--dtype", "float32",
            "--block-sizes", "8", "--ddtree-budgets", "4", "--contexts", "16,32", "--repeats", "1", "--warmup", "0"]
    assert cli_main([*argv, "--out", str(out)]) == 0
    costs = Costs.load(out)
    assert costs.dtype == "float32" and costs.contexts == [16, 32] and sorted(costs.draft) == [8]
    assert "wrote" in capsys.readouterr().err
    assert cli_main(["profile", "--target", str(tmp_path), "--drafter", drafter, "--batch-size", "0",
                     "--block-sizes", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: --target {tmp_path} is not a model folder (no config.json there)",
                   f"error: --out {tmp_path}: give the path of the JSON file to write, in a folder that exists",
                   "error: --batch-size must be at least 1; got 0",
                   "error: --block-sizes must hold integers >= 2; got [1]"]
    assert cli_main([*argv, "--block-sizes", "16", "--out", str(out)]) == 2
    assert "above the drafter's trained block size 8" in capsys.readouterr().err


def test_dflash2s_selector_is_timed_apart_and_counted_in_its_round():
    from dflash_callbacks.demos.toy.dflash2 import toy_dflash2_config
    from dflash_callbacks.model import build_drafter

    model, _ = load_target(toy_target_path(), dtype=torch.float32)
    costs = profile_costs(model, build_drafter(toy_dflash2_config()), block_sizes=[8], ddtree_budgets=[4],
                          contexts=[32], repeats=2, warmup=0)
    assert sorted(costs.selector) == [8] and costs.selector[8] > 0 and costs.drafter["family"] == "dflash2"
    assert costs.draft_round(8) == costs.draft[8] + costs.selector[8]
