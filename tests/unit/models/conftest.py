"""Make `tests.fixtures` importable from the model tests (pytest puts only this folder on sys.path)."""
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[3])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
