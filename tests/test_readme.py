"""The README's attach snippet is the example script, and the example runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_attach_snippet_is_the_example_script():
    readme = (REPO / "README.md").read_text()
    snippet = re.search(r"## Attach to an existing run.*?```python\n(.*?)```", readme, flags=re.S).group(1)
    example = (REPO / "examples" / "attach_to_existing_run.py").read_text()
    code = example.split('"""', 2)[2].strip()
    assert code.startswith(snippet.strip()), "the README's snippet and examples/attach_to_existing_run.py differ"


def test_the_example_runs_as_written(tmp_path):
    """In a fresh folder, as a user runs it; its run folder lands under runs/attach-example/dflash/."""
    run = subprocess.run([sys.executable, str(REPO / "examples" / "attach_to_existing_run.py")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600, env={**os.environ, "WANDB_MODE": "offline"})
    assert run.returncode == 0, run.stderr[-4000:]
    assert "3 reports in runs/attach-example/dflash/" in run.stdout
    (folder,) = (tmp_path / "runs" / "attach-example" / "dflash").iterdir()
    assert len((folder / "results.jsonl").read_text().splitlines()) == 3
