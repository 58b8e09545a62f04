"""`CheckpointWatcher` (`dflash-callbacks watch --checkpoints DIR`, or a program's own, built from a
`WatchSettings`): score the checkpoints a trainer saves, with no change to its code.

Point it at the folder the trainer saves into. Each poll lists DIR's entries whose name holds a
step (the last integer in the name, or the first group of --step-pattern), and scores each new
checkpoint once, in step order, as soon as it is complete:
- an HF-format drafter folder: `config.json` and safetensors (one file, or shards and their
  index), as `save_pretrained` and `dflash_callbacks.save_drafter` write it (`checkpoint-500/`,
  `step_500/`), or at `model/consolidated/` inside the step's folder, as NeMo Automodel writes it
  (`epoch_0_step_500/model/consolidated/`);
- with --state-key KEY, a torch checkpoint file (`*.pt`, `*.pth`, `*.bin`, `*.ckpt`), or the
  --state-file in a checkpoint folder (SpecForge: `run-step500/training_state.pt`), holding the
  drafter's state dict under KEY; read with `weights_only=True` (no code is unpickled), wrapper
  prefixes (`module.`, `draft_model.`, `_orig_mod.`) stripped, with the config of --drafter-config.
  Without --state-key, torch files naming a step are not read, and a line says so.
Complete means the trainer's own marker is there (the transformers Trainer writes
`trainer_state.json` after the model files), or the checkpoint's files (names, sizes, mtimes)
have not changed for --settle-seconds as this watcher saw them, by its own clock; an HF folder
must also be whole (config.json, every shard its index or names announce, each safetensors file
as long as its header says), a torch file a whole zip archive, or in the legacy format
(`_use_new_zipfile_serialization=False`, which has no end to test: settled is whole). A checkpoint
is never read before that.

Step order: a complete checkpoint is not scored while an earlier one is still being written (no
marker, and its files changed within --settle-seconds), so a later save that completes first (the
Trainer's marker, an atomic save, a busy watcher that saw the earlier one's last write late) waits
for it. An earlier one that has settled and is still not whole (a save that died) holds nothing
back: it is waited for, said once, and scored whenever it completes, after the later ones.

A damaged checkpoint (a safetensors header that is none, a config.json that does not parse, a
symlink loop; anything its reading raises) is one error line naming its file, and the watcher goes
on; there at start, it is no reason to refuse the run (see `check`). A symlink loop that names no
step (`latest -> latest`) is passed over like any entry without a step.

Scoring and publishing go through the evaluation engine every adapter uses, into one run folder,
--out (default DIR/dflash-eval): results.jsonl first, then W&B (--wandb-project: the `dflash/`
keys against `dflash/step`, each row at the checkpoint's step), then the stop (with --baseline:
TrailingBaselineStop's settings as flags), whose decision is printed and written to --out/STOP.json
for a training loop to poll. A restart, after a SIGKILL too, reopens --out: a step with a report
or an error line in results.jsonl is never scored again, and every other one is. A checkpoint
seen and then deleted before it was scored (the trainer's rotation) is an error line naming its
step. A checkpoint of another drafter shape than the run's is refused naming its file: for those
present at start, before anything is scored; for a later one, as its error line.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from functools import partial
from pathlib import Path

from ..engine.eval_engine import EvalEngine
from ..engine.open_run import basis_changes
from ..engine.run_folder import RunFolder, RunFolderBusy, is_run_folder
from ..engine.runners.jobs import Job
from ..engine.stop import StopPolicy
from ..files import atomic_write_json
from ..model.io import UnreadableFile
from ..scoring.service import ServiceSpec, preflight
from ..settings import EvalSettings
from .checkpoint_files import Drafter, drafter_shapes, failure
from .checkpoint_folder import Checkpoints
from .scan_plan import Seen, plan_scan
from .watch_host import WatchHost
from .watch_settings import WatchSettings

STOP_FILE = "STOP.json"
WANDB_HELD_SECONDS = 60.0
"""How long a restarted watcher waits for the W&B run a killed one held (its service outlives it a while)."""


class WatchedStop(StopPolicy):
    """TrailingBaselineStop's rule as the watcher follows it (its flags are its settings), named so in its lines."""

    NAME = "TrailingBaselineStop"


class CheckpointWatcher:
    """Scores the checkpoints a trainer saves into `settings.checkpoints` (see the module doc): `check`, then
    `run` (or `scan` and `publish` at each poll of your own), then `close`; `summary` sums it up."""

    def __init__(self, settings: WatchSettings):
        if not isinstance(settings, WatchSettings):
            raise TypeError(f"CheckpointWatcher takes a WatchSettings; got {type(settings).__name__}")
        self.settings = s = settings
        self.root, self.out, self.settle = s.checkpoints, s.out_folder, s.settle_seconds
        self.poll_seconds, self.idle_exit, self.once = s.poll_seconds, s.idle_exit, s.once
        self.spec = ServiceSpec(
            cache=str(s.cache), target=str(s.target), baseline=None if s.baseline is None else str(s.baseline),
            scoring=s.scoring, baseline_cache_dir=None if s.baseline_cache_dir is None else str(s.baseline_cache_dir),
        )
        self.checkpoints = Checkpoints(self.root, s.step_pattern, s.state_key, s.state_file, s.config, self.out,
                                       say=lambda line: print(line, file=sys.stderr, flush=True))
        self.host = WatchHost(s.max_steps, s.trackers())
        self.engine = EvalEngine(EvalSettings(s.cache, s.target, s.baseline, scoring=self.spec.scoring,
                                              runner="thread", keep_last=0, dirpath=self.out.parent,
                                              baseline_cache_dir=s.baseline_cache_dir))
        if s.stop is not None:
            self.engine.add_stop(WatchedStop(s.stop))
        self.started = False
        self.done: set[int] = set(self.results_steps())  # steps with a report or an error line, or submitted
        self.seen: dict[int, Seen] = {}
        self._said: dict[object, str] = {}

    def say_once(self, key: object, line: str) -> None:
        if self._said.get(key) != line:
            self._said[key] = line
            print(line, flush=True)

    def results_steps(self) -> list[int]:
        if not is_run_folder(self.out):
            return []
        results = RunFolder(self.out).read_results()
        return [r.step for r in results.reports] + [e["step"] for e in results.errors if isinstance(e.get("step"), int)]

    # ---- before any scoring
    def check(self) -> None:
        """The checkpoints there now, whole and not scored yet, are all the run's drafter (that of
        --drafter-config, else of the first one there), and the drafter, cache, target, baseline and
        scoring config fit together; else ValueError (or PreflightError) listing every problem.
        Without any checkpoint or --drafter-config yet, what needs no drafter is checked now and the
        rest with the first checkpoint. A damaged checkpoint (a file that does not read) is no
        reason to refuse: it is an error line naming it when its turn comes; a torch file that reads
        but holds no state dict under --state-key is (the flag is wrong)."""
        c = self.checkpoints
        if c.config is not None:
            given = f"--drafter-config {self.settings.drafter_config}"
            c.know(Drafter(c.config, drafter_shapes(c.config), given))
        problems = []
        for step, source in sorted(c.find().items()):
            if c.unfinished(source) or (step in self.done and c.drafter is not None):
                continue  # still being written (checked once it is whole), or scored before a restart
            try:
                config, shapes, weights = c.shapes(source)
            except Exception as e:
                if c.state_key is not None and isinstance(e, ValueError) and not isinstance(e, UnreadableFile):
                    problems.append(str(e))
                continue
            if c.drafter is None:
                c.know(Drafter(config, dict(shapes), str(source / "config.json")))
            problems += c.problems(source, config, shapes, weights)
        if problems:
            raise ValueError("checkpoints the watcher can not score:\n  " + "\n  ".join(problems))
        if c.drafter is None:
            preflight(self.spec, None)
        else:
            self.begin()

    def begin(self) -> None:
        """Check the run's drafter against everything, then open --out (fresh, or reopened) and start scoring."""
        drafter = self.checkpoints.drafter
        self.engine.check(self.host, None, drafter.config, shapes=drafter.shapes)
        if is_run_folder(self.out):
            changed = basis_changes(self.engine.basis, RunFolder(self.out))
            if changed:
                raise ValueError(f"--out {self.out} holds reports scored with {'; '.join(changed)}: watch with its "
                                 "settings, or give another --out")
        elif self.out.is_dir() and not any(self.out.iterdir()):
            self.out.rmdir()  # an empty folder made beforehand: the run folder takes its place
        if is_run_folder(self.out):
            self.engine.load_state_dict({"run_id": self.out.name})  # a restart: reopened, results.jsonl read back
        try:
            self.engine.start(self.host, None, run_id=self.out.name)
        except RunFolderBusy as e:
            raise ValueError(f"--out {self.out}: {e}; another watcher writes there: stop it or give another "
                             "--out") from None
        self.started = True
        try:
            self.engine.run.update_about({"checkpoints": str(self.root.resolve()),
                                          "state_key": self.checkpoints.state_key})
            if self.settings.wandb_project is not None:
                self.host.use_wandb(self.start_wandb())
        except BaseException:
            self.close(ok=False)
            raise

    def start_wandb(self):
        """The W&B run the reports go to, resumed after a restart (its id is in run.json)."""
        import wandb

        s, about = self.settings, self.engine.run.about()
        run_id = about.get("wandb_id") or uuid.uuid4().hex[:12]
        # a W&B service of its own, which dies with this process: one inherited from the process that started
        # the watcher (WANDB_SERVICE) would keep a killed watcher's run open, and refuse the restart its id
        os.environ.pop("WANDB_SERVICE", None)
        deadline = time.monotonic() + WANDB_HELD_SECONDS
        while True:
            try:
                run = wandb.init(project=s.wandb_project, name=s.wandb_name, group=s.wandb_group, id=run_id,
                                 resume="allow", dir=str(self.out), job_type="dflash-eval",
                                 config={"dflash_watch": {"checkpoints": str(self.root.resolve()), "out": str(self.out)}})
                break
            except Exception as e:
                if "in use" in str(e) and time.monotonic() < deadline:  # a killed watcher's W&B service still holds it
                    print(f"watch: W&B run {run_id} is still held (a killed watcher's service?); trying again",
                          flush=True)
                    time.sleep(2.0)
                    continue
                raise ValueError(f"W&B could not start a run: {type(e).__name__}: {e} (run `wandb login`, or set "
                                 "WANDB_MODE=offline)") from None
        self.engine.run.update_about({"wandb_id": run_id})
        return run

    # ---- polling
    def scan(self) -> int:
        """Submit every complete checkpoint not scored yet, in step order (one still being written holds
        back the later ones: see the module doc), and an error for each one seen and then deleted
        before it was scored. Returns how many were submitted."""
        c, now = self.checkpoints, time.monotonic()
        found = c.find()
        for step, names in c.duplicates.items():
            self.say_once(("duplicate", step), f"watch: {', '.join(names)} all name step {step}: scoring {names[0]}")
        if c.unread:
            shown = ", ".join(c.unread[:4]) + (f" and {len(c.unread) - 4} more" if len(c.unread) > 4 else "")
            self.say_once("unread", f"watch: {shown} in {self.root}: torch checkpoint files are read only with "
                                    "--state-key KEY (the key of the drafter's state dict in them, SpecForge: "
                                    "draft_state_dict) and --drafter-config CONFIG; without them, HF-format folders")
        plan = plan_scan(found, self.done, self.seen, now, self.settle, c.fingerprint, c.marked, c.unfinished)
        self.seen, ready, deleted = plan.seen, plan.ready, plan.deleted
        for key, line in plan.said:
            self.say_once(key, line)
        if not self.started:
            if not ready or not self.start_with([self.seen[step].source for step in ready]):
                return 0  # a checkpoint deleted before then is recorded once there is a run folder
        submitted = sorted(ready + deleted)
        for step in submitted:
            seen = self.seen[step]
            self.host.saw(step)
            self.engine.submit(Job(step, seen.fingerprint, folder=seen.source, read=partial(self.read, seen.source, step)))
            self.done.add(step)
        return len(submitted)

    def read(self, source: Path, step: int):
        """The checkpoint's drafter, read when its scoring starts (on the runner's thread), which it says."""
        print(f"watch: step {step}: scoring {source}", flush=True)
        return self.checkpoints.read(source, step)

    def summary(self) -> str:
        """What it did, said at exit: steps scored and errors, the last report's monitored number (every
        method's live tau without a stop) and the stop's state."""
        reports, errors = self.engine.publisher.reports, self.engine.errors
        said = f"watch: exiting: {len(reports)} step(s) scored, {errors} error(s)"
        policy = self.engine.policies[0] if self.engine.policies else None
        if reports:
            last = max(reports, key=lambda r: r.step)
            if policy is not None and policy.speedup:  # the predicted speed-ups the history keeps
                found = next((h.get("speedup") or {} for h in self.engine.history if h["step"] == last.step), {})
                found = found.get(policy.tau_monitor, {})
                against = f" (the baseline's {found['baseline'][0]:.2f})" if "baseline" in found else ""
                ours = f"{found['ours'][0]:.2f}" if "ours" in found else "not predicted"
                said += f"; the last report, step {last.step}: {policy.monitor} {ours}{against}"
            elif policy is not None:
                base = self.engine.baseline_report
                against = f" (the baseline's {base.value(policy.monitor):.2f})" if base is not None else ""
                said += f"; the last report, step {last.step}: {policy.monitor} {last.value(policy.monitor):.2f}{against}"
            else:
                said += f"; the last report, step {last.step}: live tau " + ", ".join(
                    f"{m} {last.value(f'{m}/live'):.2f}" for m in last.methods)
        if policy is not None:
            decision = policy.last_decision
            said += (f"; the stop: {policy.stop_reason}" if policy.stop_reason else
                     f"; the stop: {decision.reason}" if decision is not None else "; the stop: no report judged yet")
        return said

    def start_with(self, sources: list[Path]) -> bool:
        """The first of `sources` that reads, when no checkpoint was there at start: it is the run's
        drafter. False while none reads (each says why, once); they are scored, as error lines naming
        them, once one does."""
        c = self.checkpoints
        if c.drafter is None:
            for source in sources:
                try:
                    config, shapes, _ = c.shapes(source)
                except Exception as e:
                    self.say_once(("unreadable", source), f"watch: {failure(source, e)}")
                    continue
                c.know(Drafter(config, dict(shapes), str(source / "config.json")))
                break
            else:
                return False
        self.begin()
        return True

    def publish(self) -> None:
        """Publish what is finished. A stop decided is written to --out/STOP.json for the training loop
        to poll, unless one is there: the first stop stands until someone removes the file."""
        reason = self.engine.poll()
        if reason is not None and not (self.out / STOP_FILE).exists():
            atomic_write_json(self.out / STOP_FILE, {"stop": True, "reason": reason, "time": time.time(),
                                                     "monitor": self.engine.policies[0].monitor})
            print(f"watch: STOP: {reason} (written to {self.out / STOP_FILE})", flush=True)

    def run(self) -> int:
        mode = f"--state-key {self.checkpoints.state_key!r}" if self.checkpoints.state_key else "HF drafter folders"
        every = "once" if self.once else f"every {self.poll_seconds:g} s"
        print(f"watch: scoring the checkpoints in {self.root} ({mode}) into {self.out} ({every}, complete after "
              f"{self.settle:g} s unchanged{'' if self.once else '; Ctrl-C stops'})", flush=True)
        last_work = time.monotonic()
        if self.once:
            self.scan()
            if self.settle > 0 and set(self.seen) - self.done:
                time.sleep(self.settle)  # what is there now, once it has settled
                self.scan()
            for step in sorted(set(self.seen) - self.done):
                print(f"watch: step {step} ({self.seen[step].source}) is not complete: left for the next run",
                      flush=True)
            if not self.started:
                print(f"watch: no complete checkpoint in {self.root}", flush=True)
        while True:
            if not self.once and self.scan():
                last_work = time.monotonic()
            self.publish()
            if self.engine.pending:
                last_work = time.monotonic()
            elif self.once or (self.idle_exit is not None and time.monotonic() - last_work > self.idle_exit):
                return 0
            time.sleep(min(self.poll_seconds, 0.2) if self.engine.pending else self.poll_seconds)

    def close(self, ok: bool) -> None:
        """The last reports (when `ok`: all pending are scored first; else what is running is left
        for the next start), the run folder released, the W&B run finished."""
        try:
            if self.started:
                self.started = False
                if ok:
                    self.engine.close(wait=True, reason="the watcher is exiting")
                else:
                    self.engine.close(wait=False, reason="the watcher stopped", publish=False)
        finally:
            if self.host.wandb_run is not None:
                self.host.wandb_run.finish(exit_code=0 if ok else 1)
                self.host.use_wandb(None)


def run_watch_checkpoints(settings: WatchSettings) -> int:
    """`watch --checkpoints`, with the settings its flags filled (`cli.watch.checkpoint_settings`)."""
    watcher = CheckpointWatcher(settings)
    watcher.check()
    ok = False
    try:
        watcher.run()
        ok = True
    finally:
        try:
            watcher.close(ok)
        finally:  # also on Ctrl-C
            print(watcher.summary(), flush=True)
    return 0
