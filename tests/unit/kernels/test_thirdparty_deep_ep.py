"""The DeepEP backend of `moe_ep_dispatch` (`kernels/thirdparty/deep_ep.py`).

On the CPU (always): a 2-rank expert-parallel group is emulated with two threads, each holding a stand-in
`deep_ep` module (installed in `sys.modules`, so the adapter sizes and builds its `Buffer` itself) written here
from DeepEP's source (main, 2.1.0; 1.x has the same checks): `deep_ep/buffers/legacy.py` `Buffer` (its Python
signatures, defaults and return tuples: `get_dispatch_layout -> (per rank, None, per expert, is_token_in_rank,
event)`, `dispatch -> (recv_x, recv_topk_idx local or -1, recv_topk_weights 0 on the -1 slots, list of counts,
handle, event)`, `dispatch(x, handle=) -> (recv_x, None, None, None, None, event)`, `combine -> (sum over
destination ranks, summed weights, event)`), and the checks of `csrc/legacy/buffer.hpp`, `config.hpp` and the
intranode kernels (`csrc/kernels/legacy/intranode.cu`, `launch.cuh`): dtypes, contiguity, shapes, the 16-byte
rows, the SM90 dispatch kernel's TMA buffer, top-k <= 32, local experts <= 128, the ranks the kernels are built
for, the NVL buffer's size, the torch-deterministic assert, PCIe groups. A call the real package would refuse
fails here. The sharded forward and backward must equal the unsharded experts module (inputs, routing weights
and expert weight gradients), the layout translation must equal the stand-in's own, and the cases DeepEP refuses
fall back to the torch all-to-all with a logged reason. On a GPU with deep_ep and 2 GPUs:
tests/gpu/test_gpu_thirdparty_deep_ep.py.
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

EP, E, HIDDEN, INTER, K, N = 2, 4, 16, 6, 2, 7
_INT_MAX = 2**31 - 1


class _World:
    def __init__(self, ep):
        self.barrier = threading.Barrier(ep, timeout=30)
        self.slots = [None] * ep
        self.buffers = []

    def exchange(self, rank, value):
        self.slots[rank] = value
        self.barrier.wait()
        seen = list(self.slots)
        self.barrier.wait()
        return seen


class _Group:
    """A process group as DeepEP's Buffer reads it (`rank()`, `size()`), on a GPU named `device_name`."""

    def __init__(self, world, rank, size, device_name="NVIDIA H100 80GB HBM3"):
        self.world, self._rank, self._size, self.device_name = world, rank, size, device_name

    def rank(self):
        return self._rank

    def size(self):
        return self._size


class _Event:  # deep_ep.utils.event.EventOverlap: returned (never None) by every call
    event = None


class Config:
    """deep_ep._C.Config (csrc/legacy/config.hpp): its asserts and `get_nvl_buffer_size_hint`."""

    def __init__(self, num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv):
        assert num_sms >= 0 and 0 < nvl_send < nvl_recv and rdma_send > 0
        self.num_sms, self.nvl_send, self.nvl_recv = num_sms, nvl_send, nvl_recv

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        assert num_ranks < 8 or num_ranks % 8 == 0
        assert num_ranks <= 8 or self.num_sms % 2 == 0
        rdma, nvl, channels = max(num_ranks // 8, 1), min(num_ranks, 8), self.num_sms // 2
        slots = channels * nvl * self.nvl_recv
        idx_bytes = torch.empty(0, dtype=_FAKE.topk_idx_t).element_size()
        n = channels * nvl * (2 * rdma + 3) * 4 + slots * hidden_bytes + slots * 8  # 8 = sizeof(SourceMeta)
        n += slots * 128 * idx_bytes + slots * 128 * 4 + slots * 128 * 4  # 128 top-k ids / weights, 128 scales
        return (n + 127) // 128 * 128


class FakeBuffer:
    """DeepEP's Buffer (deep_ep/buffers/legacy.py), intranode normal mode, one per rank, exchanging through the
    group's `_World`. Every check below names the DeepEP function that makes it."""

    num_sms = 20
    COMBINE_DTYPES = (torch.bfloat16,)  # intranode.cu combine: SWITCH_TYPES has CUDA_R_16BF only
    SM90 = True  # built with SM90 features (the TMA copies of the dispatch kernel)

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                 allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=False,
                 enable_shrink=False, comm=None):
        if group is None:
            raise ValueError("Either 'group' or 'comm' must be provided.")
        if "PCIE" in group.device_name:  # utils/envs.py check_nvlink_connections
            assert group.size() <= 2, "PCIe GPUs only have pairwise NVLink connections"
        self.world, self.rank, self.ep, self.calls = group.world, group.rank(), group.size(), []
        self.group_size, self.num_nvl_bytes, self.num_rdma_bytes = group.size(), num_nvl_bytes, num_rdma_bytes
        # csrc/legacy/buffer.hpp Buffer::Buffer
        assert num_nvl_bytes % 128 == 0 and (num_nvl_bytes <= _INT_MAX or num_rdma_bytes == 0)
        assert num_rdma_bytes % 128 == 0 and (low_latency_mode or num_rdma_bytes <= _INT_MAX)
        assert 0 <= self.rank < self.ep and (self.ep <= 8 * 20 or low_latency_mode)
        assert self.ep < 8 or self.ep % 8 == 0
        if num_rdma_bytes > 0:
            assert self.ep > 8 or low_latency_mode
        self.world.buffers.append(self)

    @staticmethod
    def is_sm90_compiled():
        return FakeBuffer.SM90

    @staticmethod
    def get_dispatch_config(num_ranks):
        sizes = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)
        assert num_ranks in sizes, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(FakeBuffer.num_sms, 24 if num_ranks == 2 else 6, 256 if num_ranks <= 8 else 288, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks):
        sizes = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)
        assert num_ranks in sizes, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(FakeBuffer.num_sms, 10 if num_ranks == 2 else 4, 256 if num_ranks <= 8 else 288, 6, 128)

    @staticmethod
    def _check_deterministic():  # utils/envs.py check_torch_deterministic, called by dispatch and combine
        assert not (torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory)

    def _check_intranode(self, config, x):
        # Buffer.dispatch / combine: more than 8 ranks take the internode kernels, which need the RDMA buffer
        assert max(1, self.ep // 8) == 1 or self.num_rdma_bytes > 0, "internode without an RDMA buffer"
        assert config.num_sms % 2 == 0
        assert self.ep in (2, 4, 8), "Unsupported ranks"  # launch.cuh SWITCH_RANKS
        assert x.dim() == 2 and x.is_contiguous()
        assert x.shape[1] * x.element_size() % 16 == 0  # (hidden * element_size) % sizeof(int4)

    def _check_tma(self, x):  # intranode.cu dispatch kernel, SM90 builds: a device trap
        hidden_int4 = x.shape[1] * x.element_size() // 16
        if self.SM90:
            assert hidden_int4 % 2 == 0 and hidden_int4 // 2 * 16 + 8 <= 8192, "TMA staging buffer"

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        # csrc/legacy/buffer.hpp get_dispatch_layout (data_ptr<topk_idx_t>)
        assert topk_idx.dim() == 2 and topk_idx.is_contiguous() and num_experts > 0
        assert topk_idx.dtype == _FAKE.topk_idx_t
        if allocate_on_comm_stream:
            assert previous_event is not None and async_finish
        n_local = num_experts // self.ep
        in_rank = torch.zeros(topk_idx.shape[0], self.ep, dtype=torch.bool)
        per_expert = torch.zeros(num_experts, dtype=torch.int32)
        for t in range(topk_idx.shape[0]):
            for e in topk_idx[t].tolist():
                if e >= 0:
                    in_rank[t, e // n_local] = True
                    per_expert[e] += 1
        self.layout = (in_rank.sum(0).int(), per_expert, in_rank)
        return self.layout[0], None, per_expert, in_rank, _Event()

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        self._check_deterministic()
        config = self.get_dispatch_config(self.group_size) if config is None else config
        assert not isinstance(x, tuple), "the adapter sends bf16, not an fp8 (x, scales) pair"
        if allocate_on_comm_stream:
            assert previous_event is not None and async_finish
        if handle is not None:  # Buffer.dispatch, cached mode
            assert topk_idx is None and topk_weights is None
            recv_src, is_token_in_rank, _ = handle
            self._check_intranode(config, x)
            assert is_token_in_rank.shape == (x.shape[0], self.ep)  # intranode_dispatch
            self._check_tma(x)
            self.calls.append("dispatch(handle)")
            seen = self.world.exchange(self.rank, (x, is_token_in_rank))
            recv = torch.cat([sx[sin[:, self.rank]] for sx, sin in seen])
            return recv, None, None, None, None, _Event()
        assert num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None
        self._check_intranode(config, x)
        # csrc/legacy/buffer.hpp intranode_dispatch
        assert is_token_in_rank.dtype == torch.bool and is_token_in_rank.dim() == 2 and is_token_in_rank.is_contiguous()
        assert is_token_in_rank.shape == (x.shape[0], self.ep)
        assert num_tokens_per_expert.dtype == torch.int32 and num_tokens_per_rank.dtype == torch.int32
        assert num_tokens_per_expert.dim() == 1 and num_tokens_per_expert.is_contiguous()
        num_experts = num_tokens_per_expert.shape[0]
        assert num_experts % self.ep == 0 and num_experts // self.ep <= 1024
        assert num_tokens_per_rank.dim() == 1 and num_tokens_per_rank.is_contiguous()
        assert num_tokens_per_rank.shape[0] == self.ep
        assert (topk_idx is None) == (topk_weights is None)
        assert topk_idx is not None, "the adapter always sends its top-k"
        assert topk_idx.dim() == 2 and topk_idx.is_contiguous() and topk_idx.dtype == _FAKE.topk_idx_t
        assert topk_weights.dim() == 2 and topk_weights.is_contiguous() and topk_weights.dtype == torch.float32
        assert topk_idx.shape[0] == x.shape[0] == topk_weights.shape[0] and topk_idx.shape[1] == topk_weights.shape[1]
        num_topk, n_local = topk_idx.shape[1], num_experts // self.ep
        assert n_local <= 128 and self.ep <= 128  # intranode.cu notify_dispatch (kNumThreads = 128)
        assert num_topk <= 32 and (n_local > 0 or num_topk == 0)  # intranode.cu dispatch kernel
        self._check_tma(x)
        channels, slots = config.num_sms // 2, config.num_sms // 2 * self.ep * config.nvl_recv
        assert self.ep * (self.ep + n_local) * 4 <= self.num_nvl_bytes
        assert (self.ep * self.ep * 4 + channels * self.ep * 4 * 4 + slots * x.shape[1] * x.element_size() + slots * 4
                + slots * num_topk * topk_idx.element_size() + slots * num_topk * 4) <= self.num_nvl_bytes
        # our stand-in's own consistency: the layout it computed
        assert torch.equal(num_tokens_per_rank, self.layout[0]) and torch.equal(is_token_in_rank, self.layout[2])
        assert torch.equal(num_tokens_per_expert, self.layout[1])
        self.calls.append("dispatch")
        seen = self.world.exchange(self.rank, (x, topk_idx, topk_weights, is_token_in_rank))
        recv_src, xs, ids, ws = [], [], [], []
        for sx, sidx, sw, sin in seen:
            tokens = sin[:, self.rank].nonzero().flatten()
            recv_src.append(tokens)
            local = sidx[tokens] - self.rank * n_local
            local = torch.where((local >= 0) & (local < n_local), local, -1)
            ids.append(local)
            xs.append(sx[tokens])
            ws.append(torch.where(local >= 0, sw[tokens], 0.0))  # intranode.cu: 0 where the expert is elsewhere
        recv_ids = torch.cat(ids)
        counts = [int((recv_ids == e).sum()) for e in range(n_local)]  # expert_alignment 1
        handle = (recv_src, is_token_in_rank, x.shape[0])
        return torch.cat(xs), recv_ids, torch.cat(ws), counts, handle, _Event()

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        self._check_deterministic()
        config = self.get_combine_config(self.group_size) if config is None else config
        recv_src, _, n_mine = handle
        self._check_intranode(config, x)
        # csrc/legacy/buffer.hpp intranode_combine and intranode.cu combine
        assert x.dtype in self.COMBINE_DTYPES, "Unsupported type"
        assert x.shape[0] == sum(len(t) for t in recv_src)  # src_idx.size(0) == num_tokens
        num_topk = 0
        if topk_weights is not None:
            assert topk_weights.dim() == 2 and topk_weights.is_contiguous() and topk_weights.dtype == torch.float32
            assert topk_weights.shape[0] == x.shape[0]
            num_topk = topk_weights.shape[1]
        assert num_topk <= 32
        assert bias is None, "the adapter passes no bias"
        if allocate_on_comm_stream:
            assert previous_event is not None and async_finish
        channels, slots = config.num_sms // 2, config.num_sms // 2 * self.ep * config.nvl_recv
        assert (channels * self.ep * 8 + slots * x.shape[1] * x.element_size() + slots * 4 + slots * num_topk * 4
                <= self.num_nvl_bytes)
        self.calls.append("combine")
        seen = self.world.exchange(self.rank, (x, recv_src, topk_weights))
        out = x.new_zeros(n_mine, x.shape[1])
        out_w = None if topk_weights is None else topk_weights.new_zeros(n_mine, topk_weights.shape[1])
        for dx, dsrc, dw in seen:
            offset = sum(len(dsrc[s]) for s in range(self.rank))
            tokens = dsrc[self.rank]
            out.index_add_(0, tokens, dx[offset:offset + len(tokens)])
            if dw is not None:
                out_w.index_add_(0, tokens, dw[offset:offset + len(tokens)])
        return out, out_w, _Event()


_FAKE = types.ModuleType("deep_ep")
_FAKE.Buffer, _FAKE.Config, _FAKE.topk_idx_t = FakeBuffer, Config, torch.int64


@pytest.fixture
def fake_deep_ep(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", _FAKE)
    monkeypatch.setattr(_FAKE, "topk_idx_t", torch.int64)
    monkeypatch.setattr(adapter, "_BUFFERS", {})
    adapter._logged.clear()
    return _FAKE


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


def _run_ranks(dtype, device_name="NVIDIA H100 80GB HBM3"):
    """Both ranks through `adapter.ep_forward` and a backward, with the stand-in `deep_ep` installed (fixture)."""
    world = _World(EP)
    full = _experts(dtype)
    groups = [_Group(world, r, EP, device_name) for r in range(EP)]
    results, errors = [None] * EP, []

    def rank_main(r):
        try:
            m = _shard(full, r, groups[r])
            x, ids, w = _routing(r, dtype)
            x.requires_grad_(True)
            w.requires_grad_(True)
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
    return full, results, world


def _check_against_unsharded(full, results, dtype, **tol):
    grads_first = torch.zeros_like(full.gate_up_proj)
    grads_down = torch.zeros_like(full.down_proj)
    n_local = E // EP
    for r in range(EP):
        x, ids, w = _routing(r, dtype)
        x.requires_grad_(True)
        w.requires_grad_(True)
        ref, ref_tpe = full(x, ids, w)
        (ref * torch.linspace(-1, 1, ref.numel(), dtype=dtype).view_as(ref)).sum().backward()
        out, tpe, gx, gw, gfirst, gdown = results[r]
        torch.testing.assert_close(out, ref.detach(), **tol)
        assert tpe.tolist() == ref_tpe.tolist()
        torch.testing.assert_close(gx, x.grad, **tol)
        torch.testing.assert_close(gw, w.grad, **tol)
        grads_first[r * n_local:(r + 1) * n_local] = gfirst
        grads_down[r * n_local:(r + 1) * n_local] = gdown
    torch.testing.assert_close(grads_first, full.gate_up_proj.grad, **tol)
    torch.testing.assert_close(grads_down, full.down_proj.grad, **tol)


@pytest.mark.parametrize("topk_idx_t", [torch.int64, torch.int32])  # int32: built with EP_NUM_TOPK_IDX_BITS=32
def test_sharded_forward_and_backward_equal_the_unsharded_experts(fake_deep_ep, monkeypatch, topk_idx_t):
    # exact check in fp64: the adapter and the stand-in's combine take it here; the package itself takes bf16
    monkeypatch.setattr(adapter, "DTYPES", (torch.float64,))
    monkeypatch.setattr(FakeBuffer, "COMBINE_DTYPES", (torch.float64,))
    monkeypatch.setattr(fake_deep_ep, "topk_idx_t", topk_idx_t)
    full, results, world = _run_ranks(torch.float64)
    _check_against_unsharded(full, results, torch.float64)
    assert len(world.buffers) == EP  # one Buffer per rank, built by the adapter, kept for the backward
    for buf in world.buffers:
        assert buf.calls == ["dispatch", "combine", "dispatch(handle)", "combine"]
        hint = FakeBuffer.get_dispatch_config(EP).get_nvl_buffer_size_hint(HIDDEN * 8, EP)
        assert buf.num_nvl_bytes >= hint and buf.num_rdma_bytes == 0


def test_bf16_goes_through_the_package_checks(fake_deep_ep):
    """What the package takes: bf16 x (combine's only dtype), fp32 weights, int64 ids, hidden 16 (32-byte rows,
    an even number of 16-byte units for the SM90 dispatch kernel)."""
    full, results, world = _run_ranks(torch.bfloat16)
    _check_against_unsharded(full, results, torch.bfloat16, rtol=3e-2, atol=3e-2)
    assert [b.calls for b in world.buffers] == [["dispatch", "combine", "dispatch(handle)", "combine"]] * EP


def test_the_stand_in_refuses_what_deep_ep_refuses(fake_deep_ep):
    """The stand-in is not vacuous: the calls the real package refuses fail here before any exchange."""
    buf = FakeBuffer(_Group(_World(1), 0, EP), 10**8, 0)
    ids = torch.tensor([[0, 3], [1, 2]])
    with pytest.raises(AssertionError):
        buf.get_dispatch_layout(ids.int(), E)  # not topk_idx_t
    with pytest.raises(AssertionError):
        buf.get_dispatch_layout(ids.t().contiguous().t(), E)  # not contiguous
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    w = torch.full((2, 2), 0.5)
    bad = [
        (torch.zeros(2, 16, dtype=torch.bfloat16), w.bfloat16()),  # bf16 weights
        (torch.zeros(2, 12, dtype=torch.bfloat16), w),  # 24-byte rows
        (torch.zeros(2, 8, dtype=torch.bfloat16), w),  # an odd number of 16-byte units (SM90 TMA)
        (torch.zeros(2, 8192, dtype=torch.bfloat16), w),  # half a row + 8 bytes > 8192 (SM90 TMA)
        (torch.zeros(16, 2, dtype=torch.bfloat16).t(), w),  # not contiguous
    ]
    for x, wt in bad:
        with pytest.raises(AssertionError):
            buf.dispatch(x, topk_idx=ids, topk_weights=wt, **layout)
    ok = buf.dispatch(torch.zeros(2, 16, dtype=torch.bfloat16), topk_idx=ids, topk_weights=w, **layout)  # control
    assert len(ok) == 6 and ok[1].tolist() == [[0, -1], [1, -1]] and ok[2].tolist() == [[0.5, 0.0], [0.5, 0.0]]
    with pytest.raises(AssertionError):
        FakeBuffer(_Group(_World(1), 0, 4, "NVIDIA A100-PCIE-40GB"), 10**8 // 128 * 128, 0)
    with pytest.raises(AssertionError):
        FakeBuffer(_Group(_World(1), 0, 16), 1024, 0).dispatch(torch.zeros(2, 16, dtype=torch.bfloat16),
                                                               topk_idx=ids, topk_weights=w, **layout)
    with pytest.raises(AssertionError):
        FakeBuffer.get_dispatch_config(3)
    wide = torch.zeros(2, 33, dtype=torch.int64)
    big = FakeBuffer(_Group(_World(1), 0, EP), 2**30, 0)
    per_rank, _, per_expert, in_rank, _ = big.get_dispatch_layout(wide, E)
    with pytest.raises(AssertionError):
        big.dispatch(torch.zeros(2, 16, dtype=torch.bfloat16), topk_idx=wide, topk_weights=torch.zeros(2, 33),
                     num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)


def test_layout_translation_matches_deep_ep_layout(fake_deep_ep):
    _, ids, _ = _routing(1, torch.float32)
    ids = ids.long()
    ids[3, 1] = -1  # DeepEP: -1 = no selection
    buf = FakeBuffer(_Group(_World(1), 0, EP), 0, 0)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, E)
    ours = adapter.dispatch_layout(ids, E, EP)
    assert torch.equal(ours[0], per_rank) and torch.equal(ours[1], per_expert) and torch.equal(ours[2], in_rank)


def test_unsupported_cases_use_the_torch_all_to_all_and_say_why(fake_deep_ep, monkeypatch, caplog):
    called = []
    torch_path = lambda *a: called.append(a[0].ep_size) or "torch path"  # noqa: E731
    # the fallback is the registry's `torch` backend, loaded (and cached) once per process: patched there, not in its
    # module (an earlier test of the same process may have loaded the real function already)
    real = adapter.DEFAULT_REGISTRY.implementation
    monkeypatch.setattr(adapter.DEFAULT_REGISTRY, "implementation",
                        lambda op, name: torch_path if (op, name) == ("moe_ep_dispatch", "torch") else real(op, name))

    def experts(ep, n_local=2):
        return types.SimpleNamespace(ep_size=ep, num_local_experts=n_local)

    def x_of(hidden, dtype=torch.bfloat16):
        return torch.zeros(3, hidden, dtype=dtype)

    ids = torch.zeros(3, K, dtype=torch.int32)
    monkeypatch.setattr(adapter, "_buffer", lambda *a: pytest.fail("a Buffer was built for a refused call"))
    with caplog.at_level(logging.INFO, logger="megatron_vlm.kernels"):
        assert adapter.ep_forward(experts(2), x_of(HIDDEN, torch.float32), ids, None) == "torch path"
        assert adapter.ep_forward(experts(3), x_of(HIDDEN), ids, None) == "torch path"
        assert adapter.ep_forward(experts(16), x_of(HIDDEN), ids, None) == "torch path"  # internode
        assert adapter.ep_forward(experts(2), x_of(HIDDEN), torch.zeros(3, 33, dtype=torch.int32), None) == "torch path"
        assert adapter.ep_forward(experts(2, 129), x_of(HIDDEN), ids, None) == "torch path"
        for hidden in (12, 8, 8192):  # 24-byte rows; SM90 TMA: odd 16-byte units, half a row + 8 > 8192 bytes
            assert adapter.ep_forward(experts(2), x_of(hidden), ids, None) == "torch path"
        monkeypatch.setattr(adapter, "_device_name", lambda x: "NVIDIA A100-PCIE-40GB")
        assert adapter.ep_forward(experts(4), x_of(HIDDEN), ids, None) == "torch path"
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
        monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
        assert adapter.ep_forward(experts(2), x_of(HIDDEN), ids, None) == "torch path"
    assert called == [2, 3, 16, 2, 2, 2, 2, 2, 4, 2]
    for reason in ("torch.float32 activations", "expert-parallel size 3", "expert-parallel size 16 (DeepEP's "
                   "intranode kernels", "top-k 33", "129 experts per rank", "hidden size 12: a row of 24 bytes",
                   "hidden size 8: DeepEP's SM90", "hidden size 8192: DeepEP's SM90",
                   "expert-parallel size 4 on PCIe GPUs", "fill_uninitialized_memory"):
        assert reason in caplog.text, reason


def test_hidden_sizes_deep_ep_takes():
    """bf16 rows: multiples of 8 elements (16 bytes); SM90 builds: multiples of 16 up to 8176."""
    assert adapter.hidden_refusal(8, 2, sm90=False) is None
    assert adapter.hidden_refusal(8, 2) is not None and adapter.hidden_refusal(12, 2, sm90=False) is not None
    assert adapter.hidden_refusal(7168, 2) is None and adapter.hidden_refusal(8176, 2) is None
    assert adapter.hidden_refusal(8192, 2) is not None and adapter.hidden_refusal(8192, 2, sm90=False) is None


def test_a_build_without_sm90_features_takes_hidden_8(fake_deep_ep, monkeypatch):
    monkeypatch.setattr(FakeBuffer, "SM90", False)
    monkeypatch.setattr(sys.modules[__name__], "HIDDEN", 8)
    full, results, world = _run_ranks(torch.bfloat16)
    _check_against_unsharded(full, results, torch.bfloat16, rtol=3e-2, atol=3e-2)
    assert world.buffers[0].calls[0] == "dispatch"


def test_auto_picks_deep_ep_for_bf16_on_cuda_and_forcing_it_elsewhere_is_refused(monkeypatch):
    import megatron_vlm.kernels as K
    from megatron_vlm.kernels.registry import DEFAULT_REGISTRY

    DEFAULT_REGISTRY.clear_cache()
    try:
        monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
        if "deep_ep" not in K.DEFAULT_REGISTRY.availability("moe_ep_dispatch", torch.zeros(1))["deep_ep"]:
            pytest.skip("deep_ep is installed here")
        with K.use_backends({"moe_ep_dispatch": "deep_ep"}), \
                pytest.raises(K.BackendUnavailableError, match="deep_ep is not installed"):
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
