"""Tensor-parallel shards of the converted megatron-core layer weights (models/mcore/tp_shard.py), against
references independent of it: each rank's block must be what `hf_to_mcore` makes of that rank's share of the
HF weights as the native tp splits them (its query / KV heads' rows of q/k/v_proj, its gate / up rows, its
o_proj / down_proj columns), and the blocks of every rank must give the full tensors back, exactly. Plus the
config / `--check` side of `parallel.backend = "mcore"` with tp, and the checkpoint's tp guard."""
from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from megatron_vlm.config import load_config
from megatron_vlm.config.sections import ParallelConfig
from megatron_vlm.models.mcore.convert import hf_to_mcore
from megatron_vlm.models.mcore.tp_shard import (
    check_saved_mcore_tp,
    global_to_full,
    shard_layer_state,
    unshard_layer_state,
)
from megatron_vlm.plan.check import run_check

CONFIGS = Path(__file__).resolve().parents[3] / "launch" / "configs"
H, HEADS, KV, D, FFN = 16, 8, 4, 4, 24


def _hf_layer(g: torch.Generator, heads: int = HEADS, kv: int = KV, ffn: int = FFN, qk_norm: bool = True) -> dict:
    t = {
        "self_attn.q_proj.weight": torch.randn(heads * D, H, generator=g),
        "self_attn.k_proj.weight": torch.randn(kv * D, H, generator=g),
        "self_attn.v_proj.weight": torch.randn(kv * D, H, generator=g),
        "self_attn.q_proj.bias": torch.randn(heads * D, generator=g),
        "self_attn.k_proj.bias": torch.randn(kv * D, generator=g),
        "self_attn.v_proj.bias": torch.randn(kv * D, generator=g),
        "self_attn.o_proj.weight": torch.randn(H, heads * D, generator=g),
        "mlp.gate_proj.weight": torch.randn(ffn, H, generator=g),
        "mlp.up_proj.weight": torch.randn(ffn, H, generator=g),
        "mlp.down_proj.weight": torch.randn(H, ffn, generator=g),
        "input_layernorm.weight": torch.randn(H, generator=g),
        "post_attention_layernorm.weight": torch.randn(H, generator=g),
    }
    if qk_norm:
        t["self_attn.q_norm.weight"] = torch.randn(D, generator=g)
        t["self_attn.k_norm.weight"] = torch.randn(D, generator=g)
    return t


def _mcore(hf: dict, heads: int, kv: int) -> dict:
    out = hf_to_mcore({f"model.layers.0.{k}": v for k, v in hf.items()}, num_attention_heads=heads, num_key_value_heads=kv)
    return {k.removeprefix("decoder.layers.0."): v for k, v in out.items()}


def _native_tp_share(hf: dict, tp: int, rank: int) -> dict:
    """Rank `rank`'s share of the HF layer as the native tp splits it (ColwiseParallel rows / RowwiseParallel
    columns, parallel/tensor_parallel.py); norms whole."""
    col = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.q_proj.bias",
           "self_attn.k_proj.bias", "self_attn.v_proj.bias", "mlp.gate_proj.weight", "mlp.up_proj.weight"}
    row = {"self_attn.o_proj.weight", "mlp.down_proj.weight"}
    return {k: v.chunk(tp, 0)[rank] if k in col else v.chunk(tp, 1)[rank] if k in row else v for k, v in hf.items()}


@pytest.mark.parametrize("tp", [2, 4])
def test_rank_blocks_are_the_native_shares_and_gather_back(tp):
    hf = _hf_layer(torch.Generator().manual_seed(tp))
    full = _mcore(hf, HEADS, KV)
    blocks = [shard_layer_state(full, tp, r) for r in range(tp)]
    for r, block in enumerate(blocks):
        want = _mcore(_native_tp_share(hf, tp, r), HEADS // tp, KV // tp)  # a layer of this rank's heads / columns
        assert block.keys() == want.keys()
        for k in want:
            assert torch.equal(block[k], want[k]), (tp, r, k)
    back = unshard_layer_state(blocks)
    assert back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full)
    # what a DTensor's full tensor is: the blocks concatenated along the split dim (fc1: [gate_0; up_0; gate_1; ...])
    dims = {"self_attention.linear_qkv.weight": 0, "self_attention.linear_qkv.bias": 0,
            "self_attention.linear_proj.weight": 1, "mlp.linear_fc1.weight": 0, "mlp.linear_fc2.weight": 1}
    glob = {k: torch.cat([b[k] for b in blocks], dim=dims[k]) if k in dims else blocks[0][k] for k in full}
    assert not torch.equal(glob["mlp.linear_fc1.weight"], full["mlp.linear_fc1.weight"])  # the interleaving is real
    got = global_to_full(glob, tp)
    assert all(torch.equal(got[k], full[k]) for k in full)


def test_non_gated_mlp_is_a_plain_row_split():
    """The Nemotron-H relu^2 MLP (`gated=False`): rank r's fc1 block is its rows of up_proj as the native tp's
    ColwiseParallel takes them (no gate / up interleaving), fc2 its columns of down_proj; the global tensor is the
    full weight."""
    g = torch.Generator().manual_seed(3)
    up, down, norm = torch.randn(FFN, H, generator=g), torch.randn(H, FFN, generator=g), torch.randn(H, generator=g)
    full = {"mlp.linear_fc1.weight": up, "mlp.linear_fc2.weight": down, "pre_mlp_layernorm.weight": norm}
    blocks = [shard_layer_state(full, 2, r, gated=False) for r in range(2)]
    for r, block in enumerate(blocks):
        assert torch.equal(block["mlp.linear_fc1.weight"], up.chunk(2, 0)[r])
        assert torch.equal(block["mlp.linear_fc2.weight"], down.chunk(2, 1)[r])
        assert torch.equal(block["pre_mlp_layernorm.weight"], norm)
    assert not torch.equal(shard_layer_state(full, 2, 0)["mlp.linear_fc1.weight"], up.chunk(2, 0)[0])  # gated differs
    back = unshard_layer_state(blocks, gated=False)
    assert all(torch.equal(back[k], full[k]) for k in full)
    glob = {"mlp.linear_fc1.weight": torch.cat([b["mlp.linear_fc1.weight"] for b in blocks]),
            "mlp.linear_fc2.weight": torch.cat([b["mlp.linear_fc2.weight"] for b in blocks], dim=1),
            "pre_mlp_layernorm.weight": norm}
    got = global_to_full(glob, 2, gated=False)
    assert all(torch.equal(got[k], full[k]) for k in full)


def test_uneven_split_is_refused():
    full = _mcore(_hf_layer(torch.Generator().manual_seed(0), ffn=10), HEADS, KV)
    with pytest.raises(ValueError, match="linear_fc1.weight"):
        shard_layer_state(full, 4, 0)


def test_checkpoint_tp_guard():
    check_saved_mcore_tp({"mcore_tp": 2}, 2)
    check_saved_mcore_tp({}, 1)  # saved before the record existed: tp = 1
    check_saved_mcore_tp({"mcore_tp": 2}, None)  # native layers: nothing to check
    with pytest.raises(ValueError, match="parallel.tp = 2"):
        check_saved_mcore_tp({"mcore_tp": 2}, 1)
    with pytest.raises(ValueError, match="parallel.tp = 1"):
        check_saved_mcore_tp({}, 2)


def test_config_accepts_tp_cp_and_pp_refuses_pp_with_tp_or_cp():
    for key in ("tp", "cp", "pp"):
        ParallelConfig(backend="mcore", **{key: 2}).validate()
    for key in ("tp", "cp"):  # pipeline parallelism composes with data parallelism only, as native's
        with pytest.raises(ValueError, match=rf"pp: pipeline parallelism \(pp = 2\) composes with data parallelism only; "
                                             rf"{key} = 2 must be 1"):
            ParallelConfig(backend="mcore", pp=2, **{key: 2}).validate()


def test_check_plans_mcore_with_tp2(tmp_path):
    sets = [f'model.path="{tmp_path / "m"}"', 'parallel.backend="mcore"', "parallel.tp=2"]
    out, err = io.StringIO(), io.StringIO()
    assert run_check(load_config(CONFIGS / "demo_sft.toml", sets), world_size=2, device_memory_gib=80.0,
                     out=out, err=err) == 0, out.getvalue() + err.getvalue()
    assert "tp 2" in out.getvalue()
    with pytest.raises(ValueError, match=r"parallel.pp: pipeline parallelism \(pp = 2\).*tp = 2 must be 1"):
        load_config(CONFIGS / "demo_sft.toml", sets + ["parallel.pp=2"])
    out, err = io.StringIO(), io.StringIO()  # mcore with pp = 2 (data parallelism only) is planned
    pp_sets = sets[:2] + ["parallel.pp=2", "data.synthetic_eval_size=0",  # no evaluation through a pipeline
                         "train.micro_batches_per_step=2"]  # one micro-batch per stage at least (1F1B)
    assert run_check(load_config(CONFIGS / "demo_sft.toml", pp_sets), world_size=2,
                     device_memory_gib=80.0, out=out, err=err) == 0, out.getvalue() + err.getvalue()
