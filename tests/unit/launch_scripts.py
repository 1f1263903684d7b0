"""The launch/ scripts imported as modules (they are scripts, not a package): their argument parsers and helpers."""
from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

LAUNCH = Path(__file__).resolve().parents[2] / "launch"


def import_launch_script(name: str) -> ModuleType:
    """`launch/<name>.py` as a module (imported once, cached in sys.modules like any other)."""
    sys.path.insert(0, str(LAUNCH))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(LAUNCH))
