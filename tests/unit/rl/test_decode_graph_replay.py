"""The rollout engine's captured decode steps, with capture and replay emulated on the CPU
(tests/fixtures/fake_cuda_graphs.py: a replay re-runs the captured ATen ops on the same tensors and no Python),
against eager steps: the same greedy tokens and log-probs (fp32). Each case is a path that only a GPU would
otherwise run: the graphs kept across calls replaying weights loaded in place (with q / k / v fused into one
GEMM, and without), the on-demand paged pool growing and preempting between replays, and the expert-parallel
copy's lock-step steps (collectives captured; one gloo rank)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from megatron_vlm.inference.engine import SamplingParams
from tests.fixtures.fake_cuda_graphs import fake_cuda_graphs
from tests.fixtures.rollout_engine import SilentTokenizer, make_engine, tiny_vl_model_and_prompts

PARAMS = SamplingParams(max_new_tokens=8, n=2, temperature=0.0)


def _same(ref, got) -> None:
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-4, rtol=0)
        assert (a.routes is None) == (b.routes is None)
        if a.routes is not None:
            assert torch.equal(a.routes, b.routes)


def _replays(runners) -> int:
    return sum(b.graph.replays for r in runners for b in r.buckets.values() if b.graph is not None)


def _model_and_new_weights():
    """The engine's model and prompts, another model of other weights and those weights as a state dict."""
    model, prompts = tiny_vl_model_and_prompts(3)
    other, _ = tiny_vl_model_and_prompts(0)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.25)
    return model, prompts, other, {k: v.clone() for k, v in other.state_dict().items()}


@pytest.mark.parametrize("fuse", [False, True])
def test_kept_graphs_replay_weights_loaded_in_place(fuse, monkeypatch):
    model, prompts, other, new = _model_and_new_weights()
    ref = [make_engine(m, SilentTokenizer(), eos_token_ids=[-1], max_num_seqs=4).generate(prompts, PARAMS).samples
           for m in (copy.deepcopy(model), other)]
    runners = fake_cuda_graphs(monkeypatch)
    eng = make_engine(model, SilentTokenizer(), eos_token_ids=[-1], max_num_seqs=4, cuda_graphs="on",
                      fuse_projections=fuse)
    _same(ref[0], eng.generate(prompts, PARAMS).samples)
    runner, replays = eng._runner, _replays(runners)
    assert runner is not None and runner.captures >= 1 and replays > 0
    eng.load_weights(new, version=1)
    _same(ref[1], eng.generate(prompts, PARAMS).samples)
    assert eng._runner is runner and _replays(runners) > replays  # the kept graphs, replayed on the new weights


def test_kept_graphs_see_parameters_assigned_anew(monkeypatch):
    """Weights that arrive as new Parameter objects (`load_state_dict(assign=True)`, a `.to()` under torch's
    overwrite-on-conversion setting), then `load_weights`: the kept runner must look at the model's current
    tensors, not the objects it was built with (their addresses never change: the graphs would replay the old
    weights, which the runner's list kept alive)."""
    model, prompts, other, new = _model_and_new_weights()
    ref = make_engine(other, SilentTokenizer(), eos_token_ids=[-1], max_num_seqs=4).generate(prompts, PARAMS).samples
    fake_cuda_graphs(monkeypatch)
    eng = make_engine(model, SilentTokenizer(), eos_token_ids=[-1], max_num_seqs=4, cuda_graphs="on")
    eng.generate(prompts, PARAMS)
    assert eng._runner is not None and eng._runner.captures >= 1
    model.load_state_dict(new, assign=True)
    eng.load_weights(None, version=1)
    _same(ref, eng.generate(prompts, PARAMS).samples)


def test_paged_pool_grows_and_preempts_between_replays(monkeypatch):
    model, prompts = tiny_vl_model_and_prompts(4)
    ref = make_engine(model, SilentTokenizer(), eos_token_ids=[-1], max_num_seqs=8).generate(prompts, PARAMS).samples
    runners = fake_cuda_graphs(monkeypatch)
    block = 4
    blocks = 1 + -(-(max(len(p) for p in prompts) + PARAMS.max_new_tokens) // block) + 2  # far fewer than 8 need
    eng = make_engine(model, SilentTokenizer(), eos_token_ids=[-1], max_num_seqs=8, cuda_graphs="on",
                      kv_block_size=block, kv_cache_blocks=blocks)
    got = eng.generate(prompts, PARAMS)
    assert got.stats["preemptions"] > 0 and _replays(runners) > 0
    _same(ref, got.samples)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_expert_parallel_copy_in_lock_step(one_rank_group, tmp_path, monkeypatch):
    from megatron_vlm.checkpoint.hf import load_hf_model
    from megatron_vlm.inference.engine import RolloutPrompt
    from megatron_vlm.models.common.moe import moe_layers
    from megatron_vlm.parallel.expert_parallel import apply_ep
    from megatron_vlm.testing.synthesize import synthesize_model_folder

    full = load_hf_model(str(synthesize_model_folder("tiny_qwen3_moe", tmp_path / "m", seed=0))).eval()
    ep = copy.deepcopy(full)
    apply_ep(moe_layers(ep), one_rank_group)
    g = torch.Generator().manual_seed(1)
    prompts = [RolloutPrompt(torch.randint(0, 100, (n,), generator=g)) for n in (7, 12)]

    class Tok:
        pad_token_id, eos_token_id = 0, None

        def decode(self, ids, skip_special_tokens=False):
            return ""

    ref = make_engine(full, Tok(), eos_token_ids=[-1], record_routes=True).generate(prompts, PARAMS).samples
    runners = fake_cuda_graphs(monkeypatch)
    eng = make_engine(ep, Tok(), eos_token_ids=[-1], record_routes=True, cuda_graphs="on",
                      all_ranks_active=lambda active: active)
    _same(ref, eng.generate(prompts, PARAMS).samples)
    assert [r.sizes for r in runners] == [[4]] and _replays(runners) > 0  # lock-step: one bucket, the slot count
