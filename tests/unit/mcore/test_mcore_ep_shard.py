"""Expert-parallel shards of the converted megatron-core MoE layer weights (models/mcore/ep_shard.py), against
references independent of it: rank r's local experts must be what `moe_to_mcore` makes of the native block's
experts r * E/ep ... (r+1) * E/ep - 1 (the native `apply_ep` split), renumbered from 0 as megatron-core's
`local_experts` are; every rank's shards, and the DTensor "global" tensors (local expert j of every rank
concatenated), must give the full tensors back exactly. Plus the config / `--check` side of
`parallel.backend = "mcore"` with ep, the refusals, and the checkpoint's ep guard. (The 2-process job:
tests/integration/parallel/test_mcore_ep.py.)"""
from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from megatron_vlm.config import load_config
from megatron_vlm.config.sections import ParallelConfig
from megatron_vlm.models.mcore.ep_shard import (
    check_saved_mcore_ep,
    global_to_full_experts,
    shard_expert_state,
    unshard_expert_state,
)
from megatron_vlm.models.mcore.moe_layer import moe_to_mcore
from megatron_vlm.plan.check import run_check

CONFIGS = Path(__file__).resolve().parents[3] / "launch" / "configs"
E, H, F = 8, 6, 4


def _native_moe(g: torch.Generator, gated: bool = True) -> dict:
    return {"gate.weight": torch.randn(E, H, generator=g),
            ("experts.gate_up_proj" if gated else "experts.up_proj"): torch.randn(E, (2 if gated else 1) * F, H, generator=g),
            "experts.down_proj": torch.randn(E, H, F, generator=g)}


def _mlp(state: dict) -> dict:  # a decoder layer's MoE keys, plus a non-expert layer weight
    return {"input_layernorm.weight": torch.ones(H), **{f"mlp.{k}": v for k, v in moe_to_mcore(state).items()}}


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("gated", [True, False])
def test_rank_experts_are_the_native_split_and_gather_back(ep, gated):
    native = _native_moe(torch.Generator().manual_seed(ep), gated)
    full = _mlp(native)
    n = E // ep
    shards = [shard_expert_state(full, ep, r) for r in range(ep)]
    for r, shard in enumerate(shards):
        ref = _mlp({k: v if k == "gate.weight" else v[r * n:(r + 1) * n] for k, v in native.items()})
        assert shard.keys() == ref.keys() and all(torch.equal(shard[k], ref[k]) for k in ref), r
    back = unshard_expert_state(shards)
    assert back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full)
    # a DTensor's full tensor of local expert j: local expert j of every rank along dim 0
    global_ = {k: torch.cat([s[k] for s in shards]) if ".local_experts." in k else v for k, v in shards[0].items()}
    back = global_to_full_experts(global_, ep)
    assert back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full)


def test_uneven_and_gappy_experts_are_refused():
    full = _mlp(_native_moe(torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match="8 routed experts do not split over parallel.ep = 3"):
        shard_expert_state(full, 3, 0)
    del full["mlp.experts.local_experts.3.linear_fc1.weight"]
    with pytest.raises(KeyError, match=r"local_experts\.\*\.linear_fc1\.weight has experts \[0, 1, 2, 4, 5, 6, 7\], not 0..7"):
        shard_expert_state(full, 2, 0)


def test_checkpoint_ep_guard():
    check_saved_mcore_ep({"mcore_ep": 2}, 2)
    check_saved_mcore_ep({}, None)
    with pytest.raises(ValueError, match="saved with parallel.ep = 2"):
        check_saved_mcore_ep({"mcore_ep": 2}, 1)
    with pytest.raises(ValueError, match="saved with parallel.ep = 1"):
        check_saved_mcore_ep({}, 2)


def test_config_accepts_mcore_ep_with_and_without_tp():
    ParallelConfig(backend="mcore", ep=2).validate()
    ParallelConfig(backend="mcore", ep=2, tp=2).validate()  # 4 processes: test_mcore_tp_moe_hybrid.py (heavy)


def _check(config: str, sets: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = run_check(load_config(CONFIGS / config, sets), world_size=2, device_memory_gib=80.0, out=out, err=err)
    return rc, out.getvalue() + err.getvalue()


def test_check_plans_mcore_with_ep2(tmp_path):
    sets = ['parallel.backend="mcore"', "parallel.ep=2"]
    rc, text = _check("demo_qwen3_vl.toml", [f'model.path="{tmp_path / "m"}"', 'model.synthesize="tiny_qwen3_vl_moe"',
                                             *sets])
    assert rc == 0 and "ep 2" in text, text
    rc, text = _check("demo_nemotron_vl.toml", [f'model.path="{tmp_path / "n"}"', *sets])
    assert rc == 0 and "ep 2" in text, text
    rc, text = _check("demo_sft.toml", [f'model.path="{tmp_path / "d"}"', *sets])  # dense: no experts to shard
    assert rc == 2 and "parallel.ep" in text, text


@pytest.mark.parametrize("world,ep", [(4, 2), (8, 2), (8, 4), (8, 8)])
def test_megatron_expert_groups_are_our_ep_groups(world, ep):
    """megatron-core's expert-parallel groups for tp = pp = 1 (its default order, as `ensure_parallel_state`
    initialises it) are the ep groups of our ("ep_replicate", "ep") mesh (`build_ep_mesh`'s rank layout) for every
    world size, replicas included; the 2-process job asserts the same on live groups."""
    from megatron.core.parallel_state import RankGenerator

    theirs = RankGenerator(tp=1, ep=ep, dp=world // ep, pp=1, cp=1, order="tp-cp-ep-dp-pp").get_ranks("ep")
    ours = torch.arange(world).view(-1, ep, 1)[:, :, 0].tolist()  # parallel/mesh.py build_ep_mesh, tp = 1
    assert sorted(theirs) == sorted(ours)
