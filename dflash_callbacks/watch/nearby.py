"""The run folders near a folder that holds none: the one meant, for `watch --dir` and `plot`. No torch
here: the refusal answers before torch loads."""

from __future__ import annotations

from pathlib import Path

RUN_FILE = "run.json"  # what marks a run folder (`engine.run_folder.RUN_FILE`)


def runs_hint(root: Path, given: str = "--dir ") -> str:
    """For a folder that holds no run folder: `; did you mean GIVEN FOLDER?` naming the folder nearby that does
    (the run folder above a run's snapshots/, or a subfolder holding run folders: the demo's runs/demo/dflash
    beside runs/demo), else what a run folder is."""
    root = Path(root)
    if (root.parent / RUN_FILE).is_file():
        return f"; did you mean {given}{root.parent}?"
    holders = sorted({f.parent.parent for depth in (2, 3) for f in root.glob("*/" * depth + RUN_FILE)})
    if holders:
        return f"; did you mean {given}{holders[0]}?"
    return f" (a run folder holds {RUN_FILE}); give the callback's dirpath, e.g. runs/demo/dflash"
