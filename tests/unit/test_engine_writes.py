"""No part of the engine assigns another part's fields: read from the code itself (every assignment to an
attribute in dflash_callbacks/engine/), each part writes only its own (`self.x = ...`); the one run state
(`RunState`) changes through its own methods. What else is assigned is a value the function at hand
builds or holds alone: a run being opened, a job and its outcome on the runner's thread, a logger set up."""

from __future__ import annotations

import ast

from suite_paths import REPO

ENGINE = REPO / "dflash_callbacks" / "engine"
OWN_VALUES = {  # (file, what is assigned): a value the function builds or holds alone
    ("host.py", "log.propagate"), ("open_run.py", "opened.history"), ("open_run.py", "opened.jobs"),
    ("runners/background.py", "outcome.seconds"), ("runners/background.py", "outcome.versus"),
    ("runners/background.py", "outcome.record"), ("runners/background.py", "job.folder"),
    ("trackers/delivery.py", "destination.held"), ("trackers/delivery.py", "destination.closed"),  # its own records
}


def attribute_writes() -> set[tuple[str, str]]:
    found = set()
    for path in sorted(ENGINE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for one in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(one, ast.Attribute) and not (isinstance(one.value, ast.Name) and one.value.id == "self"):
                        found.add((str(path.relative_to(ENGINE)), ast.unparse(one)))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                found.add((str(path.relative_to(ENGINE)), "setattr"))
    return found


def test_no_engine_part_assigns_another_parts_fields():
    assert attribute_writes() == OWN_VALUES
