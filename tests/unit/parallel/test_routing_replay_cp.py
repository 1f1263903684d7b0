"""Routing replay under context parallelism (parallel.cp = 2, 2 gloo processes) against one process.

Per tiny policy (Qwen3-MoE text; Nemotron-H hybrid, whose Mamba2 layers stay unsplit while its MoE layers are
context-parallel) both ranks generate the same samples with the rollout engine recording the routes, the router
is perturbed (so that free routing sends > 5 % of tokens x layers elsewhere), and the packed training forward
replays the routes: first in one process (the reference), then with the decoder layers made context-parallel
(`apply_cp`: each rank runs its two load-balanced chunks of the pack). With replay the cp forward's log-probs
equal the one-process ones within 1e-6, every token of a rank's chunks goes to its recorded experts (the chunk
rows are written out here from the layout's definition: chunk i of 2 cp = [T i / 2cp, T (i+1) / 2cp), rank r
holds chunks r and 2cp-1-r), the router gradients summed over the ranks equal the one-process ones (cp scales a
layer's local gradient by cp: context_parallel.py) and the mismatch counts summed over the ranks equal one
process's. The same model with megatron-core's layers (`parallel.backend = "mcore"`, split the same way) replays
the same routes to the same log-probs (1e-5: another kernel order), counts and router gradients.
"""
from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.distributed as dist

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.data.processor import load_processor
from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
from megatron_vlm.models.common.moe import moe_layers
from megatron_vlm.models.common.routing_replay import recording_routes, replaying_routes
from megatron_vlm.rl.batching import TrainSample, pack_samples
from megatron_vlm.testing.synthesize import synthesize_model_folder
from megatron_vlm.training.lm_loss import TokenLogprobModel
from tests.integration.parallel.spawn import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.heavy]  # two spawned processes, two tiny policies

CP = 2
NEW = 6


def _chunk_rows(total: int, rank: int) -> torch.Tensor:
    bounds = [total * i // (2 * CP) for i in range(2 * CP + 1)]
    return torch.cat([torch.arange(bounds[c], bounds[c + 1]) for c in (rank, 2 * CP - 1 - rank)])


def _replayed(wrap, model, batch, routes):
    model.zero_grad(set_to_none=True)
    with replaying_routes(wrap, routes) as plan, recording_routes() as used:
        lp = wrap(batch)
        (lp * torch.linspace(0.5, 1.5, lp.numel())).sum().backward()
    grads = [m.gate.weight.grad.clone() for m in moe_layers(model)]
    return lp.detach(), used.stacked(), grads, torch.tensor(plan.mismatch())


def _family(tmp, rank: int, kind: str) -> None:
    from megatron_vlm.models.common.mamba2 import Mamba2Mixer
    from megatron_vlm.parallel.context_parallel import ContextParallel, apply_cp

    folder = synthesize_model_folder(kind, tmp / f"{kind}_{rank}", seed=0)  # the same weights on both ranks
    model = load_hf_model(str(folder), dtype=torch.float32).eval()
    tok = load_processor(str(folder)).tokenizer
    layers = moe_layers(model)
    g = torch.Generator().manual_seed(1)
    prompts = [RolloutPrompt(torch.randint(0, 64, (n,), generator=g)) for n in (7, 12, 4)]  # plain text ids
    engine = PolicyRolloutEngine(model, tok, EngineOptions(eos_token_ids=[-1], record_routes=True))
    out = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, n=2, temperature=1.0),
                          generator=torch.Generator().manual_seed(3)).samples
    samples = [TrainSample(prompts[s.prompt_index], s.token_ids, s.logprobs, 0.0, routes=s.routes) for s in out]
    batch = pack_samples(samples, share_prompts=False)
    routes = batch.pop("routes")
    total = routes.shape[0]
    with torch.no_grad():  # move the router between rollout and training
        gen = torch.Generator().manual_seed(7)
        for m in layers:
            if m.gate.e_score_correction_bias is not None:
                m.gate.e_score_correction_bias += torch.randn(m.num_experts, generator=gen) * 0.5
            else:
                m.gate.weight += torch.randn(m.gate.weight.shape, generator=gen) * 0.05
    wrap = TokenLogprobModel(model)
    model.train()
    mcore = copy.deepcopy(model) if importlib.util.find_spec("megatron.core") is not None else None
    ref_lp, ref_used, ref_grads, ref_counts = _replayed(wrap, model, batch, routes)
    differ, recorded = ref_counts.tolist()
    assert recorded == total * len(layers) and differ / recorded > 0.05, (kind, differ, recorded)
    assert torch.equal(ref_used.long(), routes.long())

    split = [layer for layer in model.language_model.layers
             if not any(isinstance(m, Mamba2Mixer) for m in layer.modules())]
    assert apply_cp(split, ContextParallel(dist.group.WORLD, CP, rank)) > 0
    lp, used, grads, counts = _replayed(wrap, model, batch, routes)
    torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=0)
    rows = _chunk_rows(total, rank)
    assert used.shape[0] == rows.numel() < total  # the MoE blocks ran this rank's chunks only
    assert torch.equal(used.long(), routes[rows].long()), kind  # each token went to its recorded experts
    for got, want in zip(grads, ref_grads):
        assert want.abs().sum() > 0
        dist.all_reduce(got)
        torch.testing.assert_close(got / CP, want, atol=1e-5, rtol=1e-5)
    dist.all_reduce(counts)
    assert torch.equal(counts, ref_counts), (counts, ref_counts)

    if mcore is None:  # megatron-core is a dev extra
        return
    from megatron_vlm.models.mcore.layer import use_mcore_layers

    use_mcore_layers(mcore)
    split = [layer for layer in mcore.language_model.layers
             if not any(isinstance(m, Mamba2Mixer) for m in layer.modules())]
    assert apply_cp(split, ContextParallel(dist.group.WORLD, CP, rank)) > 0
    assert all(type(m).__mro__[1].__name__ == "MoELayer" for m in moe_layers(mcore))
    lp, used, grads, counts = _replayed(TokenLogprobModel(mcore), mcore, batch, routes)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    assert torch.equal(used.long(), routes[rows].long()), kind
    for got, want in zip(grads, ref_grads):
        dist.all_reduce(got)
        torch.testing.assert_close(got / CP, want, atol=1e-5, rtol=1e-4)
    dist.all_reduce(counts)
    assert torch.equal(counts, ref_counts), (counts, ref_counts)


def _worker(tmp, rank: int) -> None:
    for kind in ("tiny_qwen3_moe", "tiny_nemotron_vl"):
        _family(tmp, rank, kind)
        dist.barrier()


def test_routing_replay_under_context_parallelism(tmp_path):
    spawn(tmp_path, _worker, world=CP)
