"""`--check`'s activation estimate under selective checkpointing + `parallel.compile`, which splits the checkpoint
of a MoE / Mamba2 decoder layer into one per child and piece (parallel/apply.py `split_selective_checkpoints`):
the estimate's extra term is checked against what the split really keeps for backward on the CPU, measured as
the storages still alive after the forward (held by the autograd graph and the checkpoints), and the plan of a
real MoE shape against the formula."""
from __future__ import annotations

import copy
import gc
import io
import re
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_vlm.parallel import apply as ac_apply
from megatron_vlm.plan.memory import estimate_memory, model_shape
from tests.fixtures.real_configs import write_real_model_folder
from tests.unit.parallel.test_compile_checkpointed import _nemotron_h, _packs, _tiny_moe_lm


class _Storages(TorchDispatchMode):
    """Weak references to the storage of every tensor an op makes."""

    def __init__(self):
        super().__init__()
        self.made: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made += [weakref.ref(t.untyped_storage()) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return out


def _kept_bytes(model, ids, cu, *, split: bool) -> int:
    """Bytes of the storages made by a forward (selective checkpointing; `split`: per child and piece) that are
    alive after it: what the graph keeps for backward. The forward's own output is reduced to a scalar."""
    ac_apply.apply_ac(model.language_model.layers, policy="selective")
    if split:
        ac_apply.split_selective_checkpoints(model.language_model.layers)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = _Storages()
    with storages:
        loss = model(ids, cu_seqlens=cu).sum()
    gc.collect()
    alive = {id(s): s for s in (r() for r in storages.made) if s is not None and s.data_ptr() not in params}
    loss.backward()  # the graph ran: it was whole
    return sum(s.nbytes() for s in alive.values())


@pytest.mark.parametrize("build", [_tiny_moe_lm, _nemotron_h], ids=["qwen3_moe", "nemotron_h"])
def test_estimate_counts_what_split_selective_checkpoints_keep(build):
    """The split checkpoints keep their inputs, which the block-wide one recomputed: the norms' outputs, the
    routing weights and expert ids, the Mamba2 scan's output (Qwen3-MoE: one MoE layer beside a dense one;
    Nemotron-H: Mamba2, MoE, attention and MLP blocks). The estimate's selective activations with
    `parallel.compile` exceed those without by what the split keeps more, measured (fp32: 4 bytes)."""
    model = build()
    ids, cu = next(_packs(([20, 28],), seed=2))
    block_wide = _kept_bytes(copy.deepcopy(model), ids, cu, split=False)
    split = _kept_bytes(copy.deepcopy(model), ids, cu, split=True)
    assert split > block_wide
    shape = model_shape(model)
    plan = dict(fsdp=1, master_bytes=4, compute_bytes=4, tokens=ids.shape[1], activation_checkpointing="selective")
    extra = estimate_memory(shape, compiled=True, **plan).activations - estimate_memory(shape, **plan).activations
    assert extra == pytest.approx(split - block_wide, rel=0.02)
    full = dict(plan, activation_checkpointing=True)
    assert estimate_memory(shape, compiled=True, **full).activations == estimate_memory(shape, **full).activations


def test_check_plans_split_checkpoints_of_moe_layers(tmp_path):
    """`--check` of Qwen3-VL-30B-A3B with selective checkpointing: with `parallel.compile` every MoE layer's split
    checkpoints keep two hidden-size norm outputs and top-8 routing weights and ids more per token, ~10 % of the
    activations; checkpointing on or off plans the same either way."""
    from megatron_vlm.config import load_config_dict
    from megatron_vlm.plan.check import run_check

    folder = write_real_model_folder("qwen3_vl_30b_a3b", tmp_path / "m")
    tokens = 4096
    got = {}
    for compiled in (False, True):
        cfg = load_config_dict({"model": {"path": str(folder)}, "parallel": {"compile": compiled},
                                "train": {"mode": "sft", "max_steps": 1, "activation_checkpointing": "selective"},
                                "data": {"train_path": "/d/train.jsonl", "max_tokens_per_pack": tokens}})
        out, err = io.StringIO(), io.StringIO()
        assert run_check(cfg, world_size=64, device_memory_gib=1000.0, out=out, err=err) == 0, out.getvalue() + err.getvalue()
        found = re.search(r"activations ([0-9.]+) GiB \(checkpointing on ([0-9.]+) GiB, selective ([0-9.]+) GiB, "
                          r"off ([0-9.]+) GiB", out.getvalue())
        assert found, out.getvalue()
        got[compiled] = tuple(map(float, found.groups()))
    act, full, sel, off = got[True]
    assert act == sel and (full, off) == (got[False][1], got[False][3])
    layers, hidden, top_k = 48, 2048, 8
    assert sel - got[False][2] == pytest.approx(tokens * layers * (2 * hidden * 2 + top_k * 12) / 2**30, abs=0.011)
    assert 0.08 < sel / got[False][2] - 1 < 0.12


def test_check_plans_split_checkpoints_of_fp32_router_blocks_under_fsdp2(tmp_path):
    """Nemotron-H under FSDP2 mixed precision: its routers are FSDP2 units of their own, so selective checkpointing
    splits their blocks' checkpoints as `parallel.compile` does (parallel/apply.py `parallelize_blocks`), and the
    plan's selective activations are the split ones; without FSDP2 units (`parallel.fsdp = false`), or in full
    precision (no fp32 units), the block-wide ones."""
    from megatron_vlm.config import load_config_dict
    from megatron_vlm.plan.check import run_check

    folder = write_real_model_folder("nemotron_3_nano_vl", tmp_path / "m")

    def selective(precision: str, **parallel) -> float:
        cfg = load_config_dict({"model": {"path": str(folder)}, "parallel": parallel,
                                "train": {"mode": "sft", "max_steps": 1, "activation_checkpointing": "selective",
                                          "precision": precision},
                                "data": {"train_path": "/d/train.jsonl", "max_tokens_per_pack": 4096}})
        out, err = io.StringIO(), io.StringIO()
        assert run_check(cfg, world_size=1, device_memory_gib=10000.0, out=out, err=err) == 0, out.getvalue() + err.getvalue()
        return float(re.search(r"activations ([0-9.]+) GiB", out.getvalue()).group(1))

    split, block_wide = selective("bf16", compile=True), selective("bf16", fsdp=False)
    assert split > block_wide
    assert selective("bf16") == split
    assert selective("fp32") * 2 / 4 == pytest.approx(block_wide, abs=0.011)  # fp32: 4 bytes per element, not split
