"""Real code that every machine has offline: the Python standard library's own sources.

Files are split once and for all by a hash of their path: about one in ten is held out
(never trained on; the toy drafter's training cache is prompted from it). Training text
comes in two kinds, so the toy target both continues code and answers chat requests:
- module source, each ended by <|endoftext|>;
- chat examples built from documented public functions: the user asks for the function in
  words taken from its signature and docstring, the assistant answers with its source.
Docstrings and comments are left out of both, so the model's English is all in requests.
"""

from __future__ import annotations

import ast
import os
import sysconfig
import zlib
from pathlib import Path

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "turtledemo"}
MAX_EXAMPLE_CHARS = 1500


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    return zlib.crc32(relative_path.encode()) % 10 == 0


def stdlib_sources(split: str) -> list[Path]:
    """Sorted .py files of the standard library (tests and site-packages excluded) in
    `split`: "train" or "heldout"."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = stdlib_root()
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in names:
            if name.endswith(".py"):
                path = Path(folder) / name
                if is_held_out(path.relative_to(root).as_posix()) == (split == "heldout"):
                    files.append(path)
    if not files:
        raise FileNotFoundError(f"no Python sources found under {root}: the toy world needs the stdlib's .py files")
    return sorted(files)


def read_source(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _drop_docstring(node: ast.AST) -> None:
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        node.body = body[1:] or [ast.Pass()]


def module_texts(source: str) -> tuple[str, list[tuple[str, str]]]:
    """(code, chat examples) of one module, both without docstrings or comments (re-printed
    by `ast.unparse`), so that what follows a chat request is always code. An example is
    (request, function source) for each documented public function: the request is written
    from the function's signature and the first paragraph of its docstring. ("", []) if
    the source does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return "", []
    documented = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue  # users ask for public functions, not private helpers or dunder methods
        if ast.get_docstring(node):
            summary = " ".join(ast.get_docstring(node).split("\n\n")[0].split())
            args = ", ".join(a.arg for a in node.args.args)
            kind = "async function" if isinstance(node, ast.AsyncFunctionDef) else "function"
            documented.append((f"Write a Python {kind} `{node.name}({args})`. {summary}", node))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            _drop_docstring(node)
    try:
        code = tab_indent(ast.unparse(tree))
        examples = [(request, tab_indent(ast.unparse(node))) for request, node in documented]
    except RecursionError:
        return "", []
    return code, [(request, body) for request, body in examples if len(body) <= MAX_EXAMPLE_CHARS]


def tab_indent(code: str) -> str:
    """One tab per indentation level instead of ast.unparse's four spaces (still valid
    Python). A byte-level model this small cannot count runs of spaces, and greedy
    decoding then loops on them; one token per level it learns quickly."""
    lines = []
    for line in code.split("\n"):
        body = line.lstrip(" ")
        lines.append("\t" * ((len(line) - len(body)) // 4) + body)
    return "\n".join(lines)
