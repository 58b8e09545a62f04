"""Scoring reads the process it runs in and never writes to it (issue 20, item 1).

The preflight, building a ScoringService, its reports and the baseline give bit-equal
numbers whatever the process-wide default dtype (and inside a caller's autocast region),
and leave the global RNGs, the default dtype, grad mode, autocast, the thread count and
the `torch.backends` flags as they found them; on CUDA also the current device and
stream, torch's peak-memory counter and the allocator's cached blocks (the CUDA tests
run only where a GPU is)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from dflash_callbacks.model.io import read_config, read_state_dict, read_state_shapes
from dflash_callbacks.scoring.service import ScoringService, ServiceSpec, preflight

from synthetic import build_world

SCORING = {"ddtree_budgets": [2, 8], "topk": [3], "anchors_per_forward": 5, "device": "cpu", "max_memory_gib": 1.0}
TIMINGS = ("seconds", "created", "peak_memory")  # how long and when, not what was scored


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """The synthetic world (a real 2-layer drafter, sliding and full attention, a target head
    in safetensors, a 3-task cache), built under the float32 default."""
    root = tmp_path_factory.mktemp("global-state")
    build_world(root)
    return root


def score_everything(world: Path, baseline_cache: Path, scoring: dict = SCORING, **service_kwargs) -> dict:
    """The whole path a run takes: preflight, the service, one report, the baseline (scored
    now: `baseline_cache` is a fresh folder). Returns what a report says, timings left out."""
    drafter = world / "baseline"
    spec = ServiceSpec(str(world / "cache"), str(world / "target"), str(drafter), scoring, str(baseline_cache))
    basis = preflight(spec, read_config(drafter), read_state_shapes(drafter))
    service = ScoringService(spec, **service_kwargs)
    ours = service.score(read_config(drafter), read_state_dict(drafter), step=3, snapshot_id="s3")
    baseline = service.baseline()
    assert baseline is not None and baseline.extra["baseline_key"]  # scored here, not read from a cache
    return {"basis": basis, **{name: {k: v for k, v in report.to_dict().items() if k not in TIMINGS}
                               for name, report in (("ours", ours), ("baseline", baseline))}}


@contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


AMBIENT = {  # what a training process may have set while the scorer runs
    "default bfloat16": lambda: default_dtype(torch.bfloat16),  # precision="bf16-true", process-wide
    "default float64": lambda: default_dtype(torch.float64),  # precision="64-true"
    "autocast bfloat16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),  # a plain loop scoring in its autocast region
}


@pytest.mark.parametrize("ambient", list(AMBIENT))
def test_the_numbers_do_not_depend_on_the_default_dtype_or_autocast(world, tmp_path, ambient):
    """A training process under precision="bf16-true" or "64-true" has its default dtype set
    while the scorer runs, and a plain loop may call it inside its autocast region; the
    reports, the baseline and the basis are those of a float32 process, bit for bit."""
    expected = score_everything(world, tmp_path / "float32")
    with AMBIENT[ambient]():
        found = score_everything(world, tmp_path / "ambient")
    assert found == expected


def global_state() -> dict:
    """Every piece of process-global (or calling-thread) torch state scoring could read or write."""
    backends = torch.backends
    state = {
        "rng": torch.get_rng_state(),
        "default_generator": torch.random.default_generator.get_state(),
        "default_dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "autocast": [(torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda")],
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn": (backends.cudnn.enabled, backends.cudnn.benchmark, backends.cudnn.deterministic,
                  backends.cudnn.allow_tf32),
        "cuda_matmul": (backends.cuda.matmul.allow_tf32, backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
                        backends.cuda.matmul.allow_bf16_reduced_precision_reduction),
        "sdp": (backends.cuda.flash_sdp_enabled(), backends.cuda.mem_efficient_sdp_enabled(),
                backends.cuda.math_sdp_enabled()),
        "mkldnn": backends.mkldnn.enabled,
        "fp32_precision": [getattr(leaf, "fp32_precision", None) for leaf in (
            backends, backends.cuda.matmul, backends.cudnn, backends.mkldnn, backends.mkldnn.matmul)],
    }
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
        state["cuda_device"] = torch.cuda.current_device()
        state["cuda_stream"] = torch.cuda.current_stream()
    return state


def assert_same_state(before: dict, after: dict) -> None:
    changed = [key for key in before if not _equal(before[key], after[key])]
    assert not changed, f"scoring changed process-global torch state: {changed}"


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("grad", [True, False])
def test_scoring_leaves_the_global_torch_state_as_it_found_it(world, tmp_path, grad):
    """Seeded training draws from the global RNG between reports: building the service (the
    target head), the preflight, a report and the baseline draw nothing from it, and leave
    the default dtype, grad mode, threads and backends flags alone."""
    torch.manual_seed(1234)
    with torch.set_grad_enabled(grad):
        before = global_state()
        score_everything(world, tmp_path / "baselines")
        after = global_state()
    assert_same_state(before, after)
    assert after["grad"] is grad


def test_the_target_head_is_built_without_a_random_init(world):
    """The head holds the target's tensors as read (no throwaway init in between): the
    global RNG does not move, and the LM head's weight is the stored one in its own dtype,
    also under another default dtype."""
    from safetensors.torch import load_file

    from dflash_callbacks import TargetHead

    stored = load_file(str(world / "target" / "model.safetensors"))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        rng = torch.get_rng_state()
        head = TargetHead.from_pretrained(world / "target")
        assert torch.equal(torch.get_rng_state(), rng)
    finally:
        torch.set_default_dtype(previous)
    assert head.lm_head.weight.dtype == head.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(head.lm_head.weight, stored["lm_head.weight"])
    assert torch.equal(head.embed_tokens.weight, stored["model.embed_tokens.weight"])
    assert not any(p.requires_grad for p in head.parameters())


# ---------------------------------------------------------------- CUDA (run where a GPU is)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA_SCORING = {**SCORING, "device": "cuda", "release_memory": True}


@cuda
def test_on_cuda_scoring_keeps_the_callers_device_stream_and_memory_counters(world, tmp_path):
    """In a shared (training) process the scorer leaves the caller's current stream and
    device, torch's peak-memory counter and the allocator's cached blocks alone: its
    report records no peak (it can not be told from training's), and release_memory
    moves the head off the GPU without emptying training's cache."""
    big = torch.empty(64 << 20, dtype=torch.uint8, device="cuda:0")  # training's peak, then a cached block
    peak, reserved = torch.cuda.max_memory_allocated(0), torch.cuda.memory_reserved(0)
    del big
    stream = torch.cuda.Stream(0)
    with torch.cuda.stream(stream):
        before = global_state()
        found = score_everything(world, tmp_path / "shared", CUDA_SCORING)
        after = global_state()
    assert_same_state(before, after)
    assert after["cuda_stream"] == stream
    assert torch.cuda.max_memory_allocated(0) >= peak  # not reset
    assert torch.cuda.memory_reserved(0) >= reserved  # not emptied
    expected = score_everything(world, tmp_path / "cpu")
    for name in ("ours", "baseline"):
        assert found[name]["tasks"].keys() == expected[name]["tasks"].keys()


@cuda
def test_on_cuda_a_scorer_that_owns_its_process_measures_its_peak_and_empties_the_cache(world, tmp_path):
    """The process runner's worker, `watch` and `score` own their process: the report's
    peak is the scorer's own (the counter is reset for it), release_memory empties the cache."""
    big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda:0")
    del big
    drafter = world / "baseline"
    spec = ServiceSpec(str(world / "cache"), str(world / "target"), None, CUDA_SCORING)
    report = ScoringService(spec, owns_process=True).score(read_config(drafter), read_state_dict(drafter))
    assert 0 < report.peak_memory < 256 << 20
    assert torch.cuda.memory_reserved(0) < 256 << 20
    shared = ScoringService(spec).score(read_config(drafter), read_state_dict(drafter))
    assert shared.peak_memory is None


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_on_a_second_gpu_scoring_runs_there_whatever_the_current_device(world, tmp_path):
    """scoring.device='cuda:1' scores on cuda:1 from a thread whose current device is 0, and
    'cuda' means cuda:0 from a thread whose current device is 1 (never the current one)."""
    drafter = world / "baseline"
    reports = {}
    for device, current in (("cuda:1", 0), ("cuda", 1)):
        with torch.cuda.device(current):
            spec = ServiceSpec(str(world / "cache"), str(world / "target"), None, {**SCORING, "device": device})
            service = ScoringService(spec)
            reports[device] = service.score(read_config(drafter), read_state_dict(drafter))
            assert torch.cuda.current_device() == current
            assert service.head.lm_head.weight.device == torch.device(device if device != "cuda" else "cuda:0")
    assert reports["cuda:1"].tasks == reports["cuda"].tasks
