"""The engine without a training loop: a watcher (`watch --checkpoints`) scores the checkpoints a
trainer saves. It checks the run's drafter by its config and tensor shapes, opens the run folder,
submits each checkpoint as a job (read when it runs) and polls: what is finished is published as
a training run's reports are, and a stop's reason comes back."""

from __future__ import annotations

from .evaluator import EvalEngine
from .runners import Job


class CheckpointFront:
    def __init__(self, engine: EvalEngine):
        self.engine = engine

    def submit(self, job: Job) -> None:
        """Rank 0, after `start`: score `job` in the background (a checkpoint a watcher found, read when the
        job runs); its outcome is published by `poll` like a snapshot's."""
        engine = self.engine
        if engine.runner is None:
            raise RuntimeError(f"{engine.name}: submit() comes after start() and before close()")
        if job.read is not None and engine.settings.runner != "thread":
            raise ValueError(f"a job read by a function is scored by the thread runner; this engine's is "
                             f"{engine.settings.runner!r}")
        engine.schedule.taken.add(job.step)
        engine.runner.submit(job)

    def poll(self) -> str | None:
        """Publish every finished outcome (results.jsonl first, then the loggers, the metrics and the
        stops); the reason of a stop decided since, or None."""
        engine = self.engine
        engine.reports.drain(engine.runner)
        return engine.deliver_stop(engine.history[-1]["step"] if engine.history else 0)
