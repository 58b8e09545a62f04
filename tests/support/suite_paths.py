"""Where the suite's pieces are: the repository, tests/ and its folders. conftest.py puts `SUPPORT` (these
helper modules) and `SCRIPTS` (the training scripts, whose in-process pieces some tests share) on sys.path;
a script run as a subprocess puts them there itself."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
SUPPORT = TESTS / "support"
SCRIPTS = TESTS / "scripts"
FIXTURES = TESTS / "fixtures"
