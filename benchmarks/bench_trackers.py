"""What a report costs the training thread in each tracker: TensorBoard (event files in a temporary folder)
and MLflow (a real `mlflow server`, sqlite backend, started here on 127.0.0.1 and killed at the end).

Each report is `--keys`-ish keys (a run of 10 tasks and the mean, 3 methods, live and dense, with the
baseline, delta and ratio, and the intervals of the means) and its per-task table, sent `--reports`
times at increasing steps through `Delivery`, as the publisher sends them; prints per tracker the
median and the largest wall time of one report, and the first's (MLflow makes its run there), and
the last's (MLflow's table is downloaded and uploaded whole at each report).

    python benchmarks/bench_trackers.py [--reports 20] [--json out.json]

Needs the dev extras (tensorboard, mlflow).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from mlflow_server import MlflowServer  # noqa: E402  (the tests' own server)

from dflash_callbacks.engine.trackers.delivery import Delivery, Table  # noqa: E402
from dflash_callbacks.engine.trackers.mlflow import MlflowTracker  # noqa: E402
from dflash_callbacks.engine.trackers.tensorboard import TensorBoardTracker  # noqa: E402

METHODS, AGGS, TASKS = ("vanilla", "ddtree@4", "ddtree@8"), ("live", "dense"), [f"task{t}" for t in range(10)] + ["mean"]


def payload(step: int) -> tuple[dict[str, float], Table]:
    keys = [f"dflash/{kind}{m}/{a}/{t}" for kind in ("", "baseline/", "delta/", "ratio/") for m in METHODS
            for a in AGGS for t in TASKS]
    keys += [f"dflash/{m}/{a}/mean_{end}" for m in METHODS for a in AGGS for end in ("lo", "hi")]
    columns = ["task"] + [f"{m} live {part}" for m in METHODS for part in ("ours", "baseline", "delta", "ratio")]
    rows = [[t] + [round(1 + 0.001 * step + 0.01 * i, 4) for i in range(len(columns) - 1)] for t in TASKS]
    return {k: 1.0 + 0.001 * step for k in keys}, Table("dflash/live_table", columns, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-trackers-"))
    server = MlflowServer(root / "server")
    server.start()
    results = {"command": "python " + shlex.join(sys.argv), "keys": len(payload(1)[0]), "table_rows": len(TASKS)}
    try:
        for tracker in (TensorBoardTracker(root / "tb"), MlflowTracker(server.url, "bench")):
            delivery, times = Delivery([tracker], print), []
            for step in range(1, args.reports + 1):
                start = time.perf_counter()
                delivery.send(step, *payload(step))
                times.append(time.perf_counter() - start)
            assert delivery.finish() == [], "a tracker failed"
            results[tracker.name] = {"median_ms": 1000 * statistics.median(times), "max_ms": 1000 * max(times),
                                     "first_ms": 1000 * times[0], "last_ms": 1000 * times[-1]}
    finally:
        server.kill()
    print(f"{results['keys']} keys and a {results['table_rows']}-row table per report, {args.reports} reports:")
    for name in ("tensorboard", "mlflow"):
        r = results[name]
        print(f"  {name:12s} median {r['median_ms']:6.0f} ms   max {r['max_ms']:6.0f} ms   "
              f"first {r['first_ms']:6.0f} ms   last {r['last_ms']:6.0f} ms")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
