"""Routing replay over multi-turn trajectories ([rl.env]): the engine records the experts of the model's AND the
environment's tokens, and the packed training forward over the whole trajectory replays them.

Tiny Qwen3-VL-MoE, an environment whose reply to turn 1 carries an image of one of two sizes (the reply prefilled
into the conversation's cache, replies of different lengths in one padded forward), turns of a few tokens:
- every trajectory carries routes `[prompt + L - 1, MoE layers, k]` (int8, k distinct experts), L counting the
  environment's tokens; the re-prefilling baseline (the whole history fed again each turn) records the same;
- unperturbed, the packed training forward over the trajectories routes every token as the rollout did (0
  mismatching (token, layer) pairs: an off-by-one in the recorded order would show here) and its log-probs of
  the model's tokens equal the rollout's;
- with the router weight perturbed, > 5 % of the pairs route elsewhere without replay; with replay every
  token, environment tokens included, goes to its recorded experts and the router gets a gradient.
"""
import pytest
import torch
from multiturn_helpers import rollout, vqa_file

from megatron_vlm.inference.policy_engine import vision_token_ids
from megatron_vlm.models.common.moe import moe_layers
from megatron_vlm.models.common.routing_replay import recording_routes, replaying_routes
from megatron_vlm.rl.batching import pack_samples
from megatron_vlm.rl.env.trajectories import trajectory_train_sample
from megatron_vlm.training.lm_loss import TokenLogprobModel

KIND = "tiny_qwen3_vl_moe"
SIZES = {"sizes": [56, 84]}  # replies with images of two sizes: chunks of different lengths share a padded forward


@pytest.fixture(scope="module")
def vqa(tmp_path_factory):
    return vqa_file(tmp_path_factory.mktemp("vqa"))


def _forward(model, batch, routes, force, *, grad=False):
    with torch.set_grad_enabled(grad), replaying_routes(model, routes, force=force) as plan, recording_routes() as used:
        lp = TokenLogprobModel(model)(batch, masked_token_ids=vision_token_ids(model))  # the engine's distribution
        if grad:
            lp.sum().backward()
    return lp.detach(), plan.mismatch(), used.stacked()


def test_multiturn_trajectories_record_and_replay_routes(vqa, tmp_path):
    model, prompts, trajs, session = rollout(KIND, vqa, tmp_path, eos_every=2, n=2, record_routes=True, kwargs=SIZES)
    assert session.engine_stats["append_padded_rows"] > 0 and session.engine_stats["decode_steps"] > 0
    model = model.float()
    layers = moe_layers(model)
    assert any(not bool(t.model_mask.all()) for t in trajs)  # environment turns inside the trajectories
    for t in trajs:
        assert t.routes is not None and t.routes.dtype == torch.int8
        assert tuple(t.routes.shape) == (t.prompt_length + t.token_ids.numel() - 1, len(layers), layers[0].top_k)
        top = t.routes.long().sort(-1).values
        assert int(top.min()) >= 0 and bool((top[..., 1:] != top[..., :-1]).all())
    _, _, again, _ = rollout(KIND, vqa, tmp_path / "reprefill", eos_every=2, n=2, record_routes=True, kwargs=SIZES,
                             reprefill=True)
    for a, b in zip(trajs, again):
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.routes, b.routes)

    samples = [trajectory_train_sample(prompts[t.prompt_index], t, advantage=1.0) for t in trajs]
    behav = torch.cat([s.behav_logp for s in samples])
    batch = {k: v for k, v in pack_samples(samples).items() if k != "num_response_tokens"}
    routes = batch.pop("routes")
    assert routes.shape[0] == batch["input_ids"].shape[1]
    lp, (differ, total), _ = _forward(model, batch, routes, force=False)
    assert total == int((routes[:, 0, 0] >= 0).sum()) * len(layers) > 0 and differ == 0, (differ, total)
    torch.testing.assert_close(lp, behav, atol=1e-5, rtol=0)

    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in layers:
            m.gate.weight += torch.randn(m.gate.weight.shape, generator=g) * 0.05
    _, (differ, total), _ = _forward(model, batch, routes, force=False)
    assert differ / total > 0.05, (differ, total)
    model.train()
    model.zero_grad()
    _, counts, used = _forward(model, batch, routes, force=True, grad=True)
    assert counts == (differ, total)
    valid = routes[:, 0, 0] >= 0
    assert torch.equal(used[valid].long(), routes[valid].long())
    assert all(m.gate.weight.grad is not None and m.gate.weight.grad.abs().sum() > 0 for m in layers)
