"""Shared by the megatron-core tests: a one-process gloo group (megatron-core's parallel state needs one),
torn down with megatron-core's model-parallel state after each module."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def mcore_state(tmp_path_factory):
    import torch.distributed as dist
    from megatron.core import parallel_state

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'init'}", rank=0,
                                world_size=1)
    yield
    parallel_state.destroy_model_parallel()
    if own:
        dist.destroy_process_group()
