"""Tests of the compiled extension megatron_vlm._C (csrc/) against the Python implementations.

The `ext` fixture fails when the extension is missing (it must be built: `pip install -e .` or
`python setup.py build_ext --inplace`), except under MEGATRON_VLM_NO_EXT=1, where it skips.
"""
import os

import pytest


@pytest.fixture
def ext():
    from megatron_vlm import _ext

    if not _ext.available():
        if os.environ.get("MEGATRON_VLM_NO_EXT", "0") not in ("", "0"):
            pytest.skip("MEGATRON_VLM_NO_EXT is set")
        pytest.fail(f"megatron_vlm._C is not available: {_ext.unavailable_reason()}")
    return _ext
