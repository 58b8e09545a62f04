"""The end of a run, the engine's (`EvalEngine` is a `RunEnd`): the last step's snapshot, then on rank 0,
with wait_on_end, the pending reports within wait_timeout; after an exception, what is on disk stays
for a resume and nothing more is logged; a process that exits with the run open ends the same way."""

from __future__ import annotations

import atexit

from torch import nn

from .results_line import final_table


class RunEnd:
    def end(self, step: int | None = None, epoch: int = 0, drafter: nn.Module | None = None,
            error: BaseException | None = None, where: str = "training") -> None:
        """Every rank, once training is over (`where` names the loop in messages: "the fit", "train()"):
        the last step's snapshot, then on rank 0, with wait_on_end, the pending reports within
        wait_timeout. After `error` (the loop raised), nothing more is logged and what is on disk stays
        for a resume."""
        try:
            if error is None and drafter is not None and step is not None:
                self.finish(step, epoch, drafter)
        finally:
            if error is not None:
                self.close(False, f"{where} stopped on {type(error).__name__}", publish=False)
            elif self.settings.wait_on_end:
                self.close(True, f"wait_timeout={self.settings.wait_timeout:g} s ran out at the end of training")
            else:
                self.close(False, f"wait_on_end=False: {where} returned without waiting for it")
        table = final_table(self.publisher.reports, self.baseline_report) if error is None else None
        if table is not None and self.settings.verbose:
            self.host.info(table)

    def close(self, wait: bool, reason: str, publish: bool = True) -> None:
        """Rank 0: with `wait`, the pending reports within `wait_timeout` (what is left then is an error line
        saying `reason`); `publish=False` when training failed (nothing is logged, what is on disk stays for a
        resume). The staging buffers go, the run folder is released."""
        atexit.unregister(self._at_exit)
        self.publisher.close()
        if self.schedule is not None:
            self.schedule.release()
        runner, self.runner = self.runner, None
        if runner is None:
            return
        if wait and runner.pending:
            self.host.info(f"{self.name}: waiting for {runner.pending} pending report(s) (steps "
                           f"{runner.pending_steps()}), at most {self.settings.wait_timeout:g} s")
        runner.close(wait, self.settings.wait_timeout, reason, keep=not publish)
        try:  # on_error="raise" may raise from here: the folder is unlocked all the same
            if publish:
                self.publisher.drain(runner)  # a baseline polled now still comes before the recovered reports
                self.publisher.settle_baseline()  # no baseline comes after this
                self.publisher.publish_recovered()
            else:
                self._keep_for_resume(runner.poll(), reason)
            self.publisher.record(None)
        finally:
            try:
                self.publisher.finish_trackers(plot=publish)
            finally:
                self.run.unlock()

    def _keep_for_resume(self, outcomes: list, reason: str) -> None:
        """Training is failing: every outcome on disk, nothing logged; a snapshot not scored stays on disk
        with no error line, for a resume to score, as after a kill."""
        left = []
        for outcome in outcomes:
            if getattr(outcome, "on_disk", None):
                left.append(outcome)
            else:
                self.publisher.keep(outcome)
        if left:
            where = ", ".join(sorted({str(o.on_disk.parent) for o in left}))
            self.host.warn(f"{self.name}: {reason}: the snapshots of steps {[o.step for o in left]} are in {where}, "
                           "not scored; a resume from a checkpoint scores them")

    def _at_exit(self) -> None:
        """The process exits with this run open (its loop raised past `end`): the runner stops before the
        interpreter does (a scoring thread alive at exit aborts the process), what is finished is kept."""
        try:
            self.close(False, "the process exited before the evaluation was closed", publish=False)
        except Exception:
            pass
