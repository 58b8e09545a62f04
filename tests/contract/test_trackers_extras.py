"""A tracker whose package is not installed is one line naming the extra that installs it (`tensorboard`,
`mlflow`): in a fresh interpreter where the package can not be imported (a `sys.meta_path` finder that
refuses it, as an interpreter without it does), asking for the tracker raises `MissingExtra` and nothing
else; with the package there, the same call makes the tracker."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, sys

class Refuse:
    '''Imports of these top-level packages fail as they do where they are not installed.'''
    def __init__(self, names):
        self.names = set(names)
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Refuse(sys.argv[1].split(",")))
from dflash_callbacks.engine.trackers.optional import MissingExtra
from dflash_callbacks.engine.trackers.tensorboard import TensorBoardTracker
from dflash_callbacks.engine.trackers.mlflow import MlflowTracker

out = {}
for label, make in (("tensorboard", lambda: TensorBoardTracker(sys.argv[2])),
                    ("mlflow", lambda: MlflowTracker("http://127.0.0.1:1", "x"))):
    try:
        out[label] = ["made", make().name]
    except MissingExtra as e:
        out[label] = ["MissingExtra", str(e)]
print(json.dumps(out))
"""


def asked(refused: str, tmp_path) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT, refused, str(tmp_path / "tb")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_missing_package_is_one_line_naming_its_extra(tmp_path):
    got = asked("tensorboard,mlflow", tmp_path)
    assert got["tensorboard"][0] == got["mlflow"][0] == "MissingExtra"
    for extra, (_, line) in got.items():
        assert "\n" not in line
        assert line.startswith(f"the {extra} tracker needs the '{extra}' extra: pip install 'dflash-callbacks[{extra}]'")
    assert not (tmp_path / "tb").exists()  # nothing made


def test_pandas_is_part_of_the_mlflow_extra_and_installed_packages_make_the_trackers(tmp_path):
    got = asked("pandas", tmp_path)
    assert got["mlflow"][0] == "MissingExtra" and "'mlflow' extra" in got["mlflow"][1]  # log_table needs pandas
    assert got["tensorboard"] == ["made", "tensorboard"]
    assert asked("nothing", tmp_path) == {"tensorboard": ["made", "tensorboard"], "mlflow": ["made", "mlflow"]}


CLI = r"""
import sys

class Refuse:
    '''mlflow is not installed: a probe (importlib.util.find_spec, as accelerate's) finds nothing, an import fails.'''
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "mlflow":
            if "importlib.util" in sys._getframe(2).f_code.co_filename:
                return None
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Refuse())
from dflash_callbacks.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_watcher_asked_for_mlflow_without_its_extra_says_so_in_one_error_line(tmp_path):
    from dflash_callbacks.demos.toy import toy_target_path

    target = toy_target_path()
    (tmp_path / "ckpts").mkdir()
    done = subprocess.run([sys.executable, "-c", CLI, "watch", "--checkpoints", str(tmp_path / "ckpts"), "--cache",
                           str(target), "--target", str(target), "--once", "--mlflow-uri", "http://127.0.0.1:1",
                           "--mlflow-experiment", "x"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        "error: the mlflow tracker needs the 'mlflow' extra: pip install 'dflash-callbacks[mlflow]' "
        "(ModuleNotFoundError: No module named 'mlflow')"]
