"""Where the shipped YAML lives: the top-level `conf/` of a source checkout (an editable
install reads it in place), or `dflash_callbacks/conf/` inside an installed wheel (the
build maps the same folder there; see pyproject.toml). One copy either way."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
CONF_DIR = _PACKAGE / "conf" if (_PACKAGE / "conf").is_dir() else _PACKAGE.parent / "conf"
TASKS_DIR = CONF_DIR / "tasks"
