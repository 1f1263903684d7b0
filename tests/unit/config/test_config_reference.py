"""The config reference (docs/config_reference.md) is generated from the dataclass docstrings and must not go
stale."""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_config_reference_is_current():
    sys.path.insert(0, str(REPO / "launch"))
    import gen_config_reference as gen

    text = gen.REFERENCE.read_text()
    assert gen.REFERENCE == REPO / "docs" / "config_reference.md"
    block = text.split(gen.BEGIN, 1)[1].split(gen.END, 1)[0]
    assert block.strip() == gen.render().strip(), "run: python launch/gen_config_reference.py --write"
