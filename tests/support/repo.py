"""Where things are: the repository's root, the tests' support folder (the helpers, and the
scripts the tests start as child processes) and the fixtures' data."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
ROOT = TESTS.parent
FIXTURES = TESTS / "fixtures"
