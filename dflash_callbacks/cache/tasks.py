"""Task sets: the prompts a cache is extracted from.

A task set is a YAML file with a `tasks` list; each task has a `name` (it also names
the task's file in a cache, so letters, digits, `_`, `-` and `.` only; `mean` is reserved
for the run-level mean over tasks in logged keys and tables) and a `prompt`
(the user's request, sent through the target's chat template at extraction):

    name: coding10
    tasks:
      - name: fizzbuzz
        prompt: Write a Python function ...

Built-in sets live in `conf/tasks/` and are loaded by name.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..checks import did_you_mean
from ..config_files import TASKS_DIR

BUILTIN_DIR = TASKS_DIR
TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
# the run-level mean over tasks (PREFIX/METHOD/AGG/mean, the table's last row) and its interval's ends (.../mean_lo, _hi)
RESERVED_TASK_NAMES = ("mean", "mean_lo", "mean_hi")
TASK_KEYS = ("name", "prompt")


def task_name_problem(name: str) -> str | None:
    """Why `name` can not name a task (None: it can): every reader and writer of task names asks this."""
    if not TASK_NAME.match(name):
        return (f"task name {name!r} is not usable as a file name: use letters, digits, '_', '-' and '.', "
                f"starting with a letter or digit")
    if name in RESERVED_TASK_NAMES:
        return (f"task name {name!r} is reserved for the mean over tasks ('mean', and its interval's ends 'mean_lo' "
                "and 'mean_hi'); rename the task")
    return None


@dataclass(frozen=True)
class Task:
    name: str
    prompt: str


def builtin_task_sets() -> list[str]:
    """Names that `load_tasks` accepts in place of a path, e.g. ['coding10']."""
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.yaml"))


def resolve_task_file(spec: str | Path) -> Path:
    """A built-in set's name -> its YAML file; anything else must be an existing file."""
    builtin = BUILTIN_DIR / f"{spec}.yaml"
    if isinstance(spec, str) and TASK_NAME.match(spec) and builtin.is_file():
        return builtin
    path = Path(spec)
    if path.is_file():
        return path
    raise FileNotFoundError(
        f"unknown task set {str(spec)!r}: give a built-in name ({', '.join(builtin_task_sets())}) "
        f"or the path of a YAML file with a 'tasks' list{did_you_mean(str(spec), builtin_task_sets())}"
    )


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, except that a key given twice in one mapping is an error (safe_load keeps the
    last: a second `tasks:` list would silently drop the first one's tasks)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # SafeLoader's own error names it
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"found the key {key!r} twice in one mapping",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_tasks(spec: str | Path) -> list[Task]:
    """The tasks of a built-in set ("coding10") or of a YAML file, in file order.

    Raises ValueError naming the file and the offending entry for: invalid YAML (a key given
    twice in one mapping included), no
    `tasks` list, an entry that is not a mapping, a missing/unknown key, a name or
    prompt that is not a string, an empty prompt, a name unfit for a file name or reserved
    (`mean`), or a duplicate name.
    """
    path = resolve_task_file(spec)
    try:
        raw = yaml.load(path.read_text(), Loader=UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is not valid YAML: {e}") from e
    if not isinstance(raw, dict) or not isinstance(raw.get("tasks"), list):
        raise ValueError(f"{path}: expected a mapping with a 'tasks' list at the top level")
    if not raw["tasks"]:
        raise ValueError(f"{path}: the 'tasks' list is empty")

    tasks: list[Task] = []
    seen: set[str] = set()
    for i, entry in enumerate(raw["tasks"]):
        where = f"{path}: tasks[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be a mapping with keys {list(TASK_KEYS)}, got {type(entry).__name__}")
        unknown = sorted(set(entry) - set(TASK_KEYS))
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown} (expected {list(TASK_KEYS)})")
        for key in TASK_KEYS:
            if key not in entry:
                raise ValueError(f"{where} has no {key!r}")
            if not isinstance(entry[key], str):
                raise ValueError(f"{where}.{key} must be a string, got {type(entry[key]).__name__}")
        name, prompt = entry["name"], entry["prompt"].strip()
        problem = task_name_problem(name)
        if problem:
            raise ValueError(f"{where}.name: {problem}")
        if not prompt:
            raise ValueError(f"{where} ({name}) has an empty prompt")
        if name in seen:
            raise ValueError(f"{where}: duplicate task name {name!r}")
        seen.add(name)
        tasks.append(Task(name=name, prompt=prompt))
    return tasks
