"""The DeepEP backend of `moe_ep_dispatch` (`kernels/thirdparty/deep_ep.py`).

On the CPU (always): a 2-rank expert-parallel group is emulated with two threads, each holding a
stand-in of DeepEP's `Buffer` written here from its documented interface — `get_dispatch_layout(topk_idx
int64, num_experts) -> (per rank, None, per expert, is_token_in_rank, event)`, `dispatch(x, num_tokens_per_rank=,
is_token_in_rank=, num_tokens_per_expert=, topk_idx=, topk_weights= fp32)` -> (recv_x, recv_topk_idx with
local ids and -1 elsewhere, recv_topk_weights, counts, handle, event), `dispatch(x, handle=)`, and
`combine(x, handle, topk_weights=) -> (sum over destination ranks, summed weights, event)`. The sharded
forward and backward must equal the unsharded experts module (inputs, routing weights and expert weight
gradients), the layout translation must equal the stand-in's own, and the unsupported cases fall back to
the torch all-to-all with a logged reason. On a GPU with deep_ep and 2 GPUs: tests/gpu/test_gpu_thirdparty_deep_ep.py.
"""
from __future__ import annotations

import copy
import logging
import sys
import threading
import types

import pytest
import torch

from megatron_vlm.kernels.thirdparty import deep_ep as adapter
from megatron_vlm.models.common.moe import GroupedExperts
from megatron_vlm.parallel.expert_parallel import _expert_parallel_class

EP, E, HIDDEN, INTER, K, N = 2, 4, 8, 6, 2, 7


class _World:
    def __init__(self, ep):
        self.barrier = threading.Barrier(ep, timeout=30)
        self.slots = [None] * ep

    def exchange(self, rank, value):
        self.slots[rank] = value
        self.barrier.wait()
        seen = list(self.slots)
        self.barrier.wait()
        return seen


class FakeBuffer:
    """DeepEP's intranode Buffer, one per rank, exchanging through `_World`."""

    def __init__(self, world, rank, ep):
        self.world, self.rank, self.ep, self.calls = world, rank, ep, []

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        assert topk_idx.dtype == torch.int64
        n_local = num_experts // self.ep
        in_rank = torch.zeros(topk_idx.shape[0], self.ep, dtype=torch.bool)
        per_expert = torch.zeros(num_experts, dtype=torch.int32)
        for t in range(topk_idx.shape[0]):
            for e in topk_idx[t].tolist():
                if e >= 0:
                    in_rank[t, e // n_local] = True
                    per_expert[e] += 1
        self.layout = (in_rank.sum(0).int(), per_expert, in_rank)
        return self.layout[0], None, per_expert, in_rank, None

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        if handle is not None:
            assert topk_idx is None and topk_weights is None
            self.calls.append("dispatch(handle)")
            seen = self.world.exchange(self.rank, x)
            recv = torch.cat([seen[src][handle[src]] for src in range(self.ep)])
            return recv, None, None, None, None, None
        self.calls.append("dispatch")
        assert topk_idx.dtype == torch.int64 and topk_weights.dtype == torch.float32
        assert torch.equal(num_tokens_per_rank, self.layout[0]) and torch.equal(is_token_in_rank, self.layout[2])
        assert torch.equal(num_tokens_per_expert, self.layout[1])
        seen = self.world.exchange(self.rank, (x, topk_idx, topk_weights, is_token_in_rank))
        n_local = E // self.ep
        handle, xs, ids, ws = [], [], [], []
        for sx, sidx, sw, sin in seen:
            tokens = sin[:, self.rank].nonzero().flatten()
            handle.append(tokens)
            local = sidx[tokens] - self.rank * n_local
            ids.append(torch.where((local >= 0) & (local < n_local), local, -1))
            xs.append(sx[tokens])
            ws.append(sw[tokens])  # the weights of the -1 slots are kept: the adapter must ignore them
        recv_ids = torch.cat(ids)
        counts = [int((recv_ids == e).sum()) for e in range(n_local)]
        return torch.cat(xs), recv_ids, torch.cat(ws), counts, handle, None

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        self.calls.append("combine")
        seen = self.world.exchange(self.rank, (x, handle, topk_weights))
        n_mine = None
        out = out_w = None
        for dx, dhandle, dw in seen:
            offset = sum(len(dhandle[s]) for s in range(self.rank))
            tokens = dhandle[self.rank]
            rows = dx[offset:offset + len(tokens)]
            n_mine = self.num_tokens
            if out is None:
                out = dx.new_zeros(n_mine, dx.shape[1])
                out_w = None if dw is None else dw.new_zeros(n_mine, dw.shape[1])
            out.index_add_(0, tokens, rows)
            if dw is not None:
                out_w.index_add_(0, tokens, dw[offset:offset + len(tokens)])
        return out, out_w, None


def _experts(dtype):
    torch.manual_seed(0)
    m = GroupedExperts(E, HIDDEN, INTER, activation="silu", gated=True)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m.to(dtype)


def _shard(full, rank, group):
    m = copy.deepcopy(full)
    n_local = E // EP
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(m, name)
        setattr(m, name, torch.nn.Parameter(w.detach()[rank * n_local:(rank + 1) * n_local].clone()))
    m.__class__ = _expert_parallel_class(type(m))
    m.ep_group, m.ep_size, m.ep_rank, m.num_local_experts = group, EP, rank, n_local
    m.replica_group, m.grad_divide_factor = None, 1.0
    return m


def _routing(rank, dtype):
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(N, HIDDEN, generator=g, dtype=dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]).to(torch.int32)
    if rank == 1:
        ids[0] = torch.tensor([0, 1])  # a token whose experts all live on the other rank
    w = torch.softmax(torch.randn(N, K, generator=g), -1).to(dtype)
    return x, ids, w


def _run_ranks(dtype, monkeypatch):
    world = _World(EP)
    full = _experts(dtype)
    groups = [types.SimpleNamespace(buffer=FakeBuffer(world, r, EP)) for r in range(EP)]
    monkeypatch.setattr(adapter, "_buffer", lambda group, hidden_bytes: group.buffer)
    results, errors = [None] * EP, []

    def rank_main(r):
        try:
            m = _shard(full, r, groups[r])
            x, ids, w = _routing(r, dtype)
            x.requires_grad_(True)
            w.requires_grad_(True)
            groups[r].buffer.num_tokens = N
            out, tpe = adapter.ep_forward(m, x, ids, w)
            (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)).sum().backward()
            results[r] = (out.detach(), tpe, x.grad, w.grad, m.gate_up_proj.grad, m.down_proj.grad)
        except BaseException as e:  # noqa: BLE001 - reported below with the rank
            errors.append((r, e))
            world.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(EP)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0][1]
    return full, results, groups


def test_sharded_forward_and_backward_equal_the_unsharded_experts(monkeypatch):
    monkeypatch.setattr(adapter, "DTYPES", (torch.float64,))  # exact check; the package itself takes bf16
    full, results, groups = _run_ranks(torch.float64, monkeypatch)
    grads_first = torch.zeros_like(full.gate_up_proj)
    grads_down = torch.zeros_like(full.down_proj)
    n_local = E // EP
    for r in range(EP):
        x, ids, w = _routing(r, torch.float64)
        x.requires_grad_(True)
        w.requires_grad_(True)
        ref, ref_tpe = full(x, ids, w)
        (ref * torch.linspace(-1, 1, ref.numel(), dtype=torch.float64).view_as(ref)).sum().backward()
        out, tpe, gx, gw, gfirst, gdown = results[r]
        torch.testing.assert_close(out, ref.detach())
        assert tpe.tolist() == ref_tpe.tolist()
        torch.testing.assert_close(gx, x.grad)
        torch.testing.assert_close(gw, w.grad)
        grads_first[r * n_local:(r + 1) * n_local] = gfirst
        grads_down[r * n_local:(r + 1) * n_local] = gdown
        assert groups[r].buffer.calls == ["dispatch", "combine", "dispatch(handle)", "combine"]
    torch.testing.assert_close(grads_first, full.gate_up_proj.grad)
    torch.testing.assert_close(grads_down, full.down_proj.grad)


def test_layout_translation_matches_deep_ep_layout():
    _, ids, _ = _routing(1, torch.float32)
    ids = ids.long()
    ids[3, 1] = -1  # DeepEP: -1 = no selection
    buf = FakeBuffer(_World(1), 0, EP)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, E)
    ours = adapter.dispatch_layout(ids, E, EP)
    assert torch.equal(ours[0], per_rank) and torch.equal(ours[1], per_expert) and torch.equal(ours[2], in_rank)


def test_unsupported_cases_use_the_torch_all_to_all_and_say_why(monkeypatch, caplog):
    called = []
    monkeypatch.setattr("megatron_vlm.parallel.expert_parallel.all_to_all_forward",
                        lambda *a: called.append(a[0].ep_size) or "torch path")
    adapter._logged.clear()
    m = types.SimpleNamespace(ep_size=2)
    x = torch.zeros(3, HIDDEN)
    with caplog.at_level(logging.INFO, logger="megatron_vlm.kernels"):
        assert adapter.ep_forward(m, x, None, None) == "torch path"
        m3 = types.SimpleNamespace(ep_size=3)
        assert adapter.ep_forward(m3, x.bfloat16(), None, None) == "torch path"
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
        monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
        assert adapter.ep_forward(m, x.bfloat16(), None, None) == "torch path"
    assert called == [2, 3, 2]
    assert "torch.float32 activations" in caplog.text and "expert-parallel size 3" in caplog.text
    assert "fill_uninitialized_memory" in caplog.text


def test_auto_picks_deep_ep_for_bf16_on_cuda_and_forcing_it_elsewhere_is_refused(monkeypatch):
    import megatron_vlm.kernels as K
    from megatron_vlm.kernels.registry import DEFAULT_REGISTRY

    DEFAULT_REGISTRY.clear_cache()
    try:
        monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
        if "deep_ep" not in K.DEFAULT_REGISTRY.availability("moe_ep_dispatch", torch.zeros(1))["deep_ep"]:
            pytest.skip("deep_ep is installed here")
        with K.use_backends({"moe_ep_dispatch": "deep_ep"}):
            with pytest.raises(K.BackendUnavailableError, match="deep_ep is not installed"):
                DEFAULT_REGISTRY.resolve("moe_ep_dispatch", torch.zeros(1, dtype=torch.bfloat16))
        monkeypatch.setitem(sys.modules, "deep_ep", types.ModuleType("deep_ep"))
        DEFAULT_REGISTRY.clear_cache()
        assert DEFAULT_REGISTRY.choose("moe_ep_dispatch", "cuda", torch.bfloat16) == "deep_ep"
        assert DEFAULT_REGISTRY.choose("moe_ep_dispatch", "cuda", torch.float32) == "torch"
        assert DEFAULT_REGISTRY.choose("moe_ep_dispatch", "cpu", torch.bfloat16) == "torch"
    finally:
        DEFAULT_REGISTRY.clear_cache()


def test_a_forced_backend_that_cannot_run_exits_2_with_the_reason(monkeypatch, tmp_path, capsys):
    import megatron_vlm.kernels as K
    from megatron_vlm import runner

    def first_forward(ctx, before_step=None):
        with K.use_backends({"moe_ep_dispatch": "deep_ep"}):
            K.DEFAULT_REGISTRY.resolve("moe_ep_dispatch", torch.zeros(1, dtype=torch.bfloat16))
        return 0

    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    K.DEFAULT_REGISTRY.clear_cache()
    monkeypatch.setattr(runner, "setup_roles", lambda cfg: None)
    monkeypatch.setattr(runner, "init_distributed", lambda: types.SimpleNamespace(is_main=True))
    monkeypatch.setattr(runner, "save_config", lambda cfg, path: None)
    monkeypatch.setattr(runner, "_prepare_model_folder", lambda cfg, env: None)
    monkeypatch.setattr(runner, "run_kind", first_forward)
    monkeypatch.setattr(runner, "destroy_distributed", lambda: None)
    monkeypatch.setattr(runner.RunContext, "__init__", lambda self, **kw: None)
    monkeypatch.setattr(runner.RunContext, "stop", types.SimpleNamespace(install=lambda: None), raising=False)
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(output_dir=str(tmp_path), mode="sft"))
    try:
        assert runner.run_job(cfg) == 2
    finally:
        K.DEFAULT_REGISTRY.clear_cache()
    err = capsys.readouterr().err
    assert "config error" in err and "'deep_ep', which cannot run" in err
