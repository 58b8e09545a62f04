"""The live speculative-sampling loop: lossless verification, the greedy cache's schedule at T = 0,
the teacher-forced tau, and (slow) the live mean inside the offline estimate's interval at T > 0."""

import pytest
import torch

from dflash_callbacks.cache.extract import extract_cache, load_target
from dflash_callbacks.cache.sampling import Sampling
from dflash_callbacks.cache.tasks import load_tasks
from dflash_callbacks.demos.toy.threads import torch_threads
from dflash_callbacks.demos.toy.world import TOY_LAYER_IDS, build_toy_cache, toy_baseline_path, toy_target_path
from dflash_callbacks.model import TargetHead, load_drafter
from dflash_callbacks.scoring.aggregates import decode_streaks
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.scoring.scorer import score_drafter
from served_live import live_runs, live_tau, mean_interval, speculative_verify
from teacher_forced import teacher_forced_taus


@pytest.fixture(autouse=True)
def one_torch_thread():
    with torch_threads(1):
        yield


def test_speculative_verify_emits_the_targets_distribution():
    """The first token a block emits follows p whatever q proposes (a draw from q, or a fixed
    argmax), and a draw from q is accepted with probability sum min(p, q)."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.1, 0.1, 0.1, 0.6]])
    q = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1]])
    n = 3000
    for rule in ("sample", "argmax"):
        counts, accepted = torch.zeros(5), 0
        for _ in range(n):
            if rule == "sample":
                drafts, proposal = torch.multinomial(q[0], 1, generator=g), q
            else:
                drafts, proposal = torch.tensor([1]), torch.tensor([[0.0, 1, 0, 0, 0]])
            k, token = speculative_verify(p, proposal, drafts, g)
            counts[int(drafts[0]) if k else token] += 1
            accepted += k
        sd = (p[0] * (1 - p[0]) / n).sqrt()
        assert ((counts / n - p[0]).abs() <= 4 * sd + 1e-9).all(), (rule, counts / n)
        assert abs(accepted / n - (0.2 if rule == "argmax" else float(torch.minimum(p[0], q[0]).sum()))) < 4 * (0.25 / n) ** 0.5


@pytest.fixture(scope="module")
def greedy_world(tmp_path_factory):
    """Two coding10 prompts, 48 new tokens: their greedy cache and the baseline's report on it."""
    tasks = load_tasks("coding10")[:2]
    cache = build_toy_cache(tmp_path_factory.mktemp("greedy") / "c", tasks, max_new_tokens=48)
    drafter = load_drafter(toy_baseline_path())
    report = score_drafter(drafter, cache, TargetHead.from_pretrained(toy_target_path()),
                           ScoringConfig(ddtree_budgets=[], device="cpu", max_rounds=48))
    return tasks, cache, report


@pytest.mark.parametrize("rule", ["argmax", "sample"])
def test_at_temperature_0_the_loop_decodes_the_greedy_text_on_the_scorers_live_schedule(greedy_world, rule):
    tasks, cache, report = greedy_world
    runs = live_runs(toy_target_path(), load_drafter(toy_baseline_path()), tasks, Sampling(), runs_per_prompt=1,
                     max_new_tokens=48, draft_rule=rule)
    for run in runs:
        assert run.tokens == cache.task(run.task).input_ids.tolist()
        assert run.taus == report.tasks[run.task]["vanilla"]["live_rounds"]


def test_at_temperature_0_the_teacher_forced_tau_is_the_dense_tau(greedy_world):
    tasks, cache, report = greedy_world
    model, _ = load_target(toy_target_path())
    drafter = load_drafter(toy_baseline_path())
    for task in tasks:
        taus = teacher_forced_taus(model, drafter, cache.task(task.name), Sampling())
        streaks = decode_streaks(report.tasks[task.name]["vanilla"]["streaks"], 8)
        assert taus.tolist() == (streaks + 1).tolist()
        warm = teacher_forced_taus(model, drafter, cache.task(task.name), Sampling(1.0, 0.95))
        assert warm.shape == taus.shape and ((warm >= 1) & (warm <= 8)).all() and not torch.equal(warm, taus)


def test_mean_interval():
    mean, lo, hi = mean_interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and hi - mean == pytest.approx(4.302653 / 3**0.5, rel=1e-5) and mean - lo == hi - mean
    with pytest.raises(ValueError, match="at least 2 values"):
        mean_interval([1.0])


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_the_live_mean_lies_in_the_offline_estimates_interval(temperature, tmp_path):
    """T = 0.7 and 1, top-p 0.95, four coding10 prompts, 48 new tokens: the scorer's live mean on a cache of
    10 answers per prompt sampled at those settings (seed 1) holds the mean of the live loop over
    5 requests per prompt (seed 0, about 780 rounds). Both are noisy estimates of the same number,
    so an interval holds the other's estimate about 83% of the time: at T = 1, over 4 x 4 seeds, 13 pairs did."""
    sampling, tasks, n = Sampling(temperature, 0.95), load_tasks("coding10")[:4], 48
    drafter = load_drafter(toy_baseline_path())
    runs = live_runs(toy_target_path(), drafter, tasks, sampling, runs_per_prompt=5, max_new_tokens=n, seed=0)
    live, lo, hi = live_tau(runs)
    cache = extract_cache(toy_target_path(), tmp_path / "sampled", tasks, TOY_LAYER_IDS, max_new_tokens=n,
                          progress=False, temperature=temperature, top_p=0.95, samples=10, seed=1)
    report = score_drafter(drafter, cache, TargetHead.from_pretrained(toy_target_path()),
                           ScoringConfig(ddtree_budgets=[], device="cpu", max_rounds=n))
    low, high = report.intervals["mean"]["vanilla"]["live"]
    offline = report.mean["vanilla"]["live"]
    assert sum(len(r.taus) for r in runs) > 600 and len(cache) == 40
    assert low <= live <= high, f"live {live:.3f} [{lo:.3f}, {hi:.3f}] outside offline {offline:.3f} [{low:.3f}, {high:.3f}]"
