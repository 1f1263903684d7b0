"""Multi-turn rollouts in the built-in engine: the trajectory's training log-probs equal the rollout's.

An image arrives in turn 2 (the environment's reply to turn 1): the engine prefills only that reply into the
conversation's KV cache (the new image through the vision tower, M-RoPE positions continued), and the packed
training forward over the whole trajectory (prompt, model turns, environment turns, both images) must give
the behaviour log-probs of every model token within 1e-5 in fp32 — packed several trajectories per pack and
one per pack. The reference is an independent full forward without any cache over the whole trajectory
(transformers' semantics of the model: tests/unit/models pin those against transformers). Only the model's
tokens carry labels. Every log-prob is of the distribution with the vision tokens removed (the one the engine
samples from: training/masked_vocab.py)."""
import pytest
import torch
from multiturn_helpers import rollout, vqa_file

from megatron_vlm.data.batch import IGNORE_INDEX, VISION_KEYS
from megatron_vlm.inference.policy_engine import vision_token_ids
from megatron_vlm.rl.batching import pack_samples
from megatron_vlm.rl.env.trajectories import trajectory_train_sample
from megatron_vlm.training.lm_loss import TokenLogprobModel


@pytest.fixture(scope="module")
def vqa(tmp_path_factory):
    return vqa_file(tmp_path_factory.mktemp("vqa"))


def _vision(p, t) -> dict:
    """The prompt's vision inputs followed by the trajectory's (placeholder order: the prompt's come first)."""
    out = {}
    for k in VISION_KEYS:
        parts = [v for v in (getattr(p, k), t.vision.get(k)) if v is not None]
        if parts:
            out[k] = torch.cat(parts)
    return out


def _masked_log_softmax(model, logits):
    """log_softmax over the ids other than the vision tokens (the engine never samples those)."""
    return torch.log_softmax(logits.index_fill(-1, torch.tensor(vision_token_ids(model)), float("-inf")), -1)


def _check_logprobs(model, prompts, trajs):
    """Packed (all trajectories in one pack, and one per pack) and cache-free full forwards give the rollout's
    behaviour log-probs within 1e-5."""
    samples = [trajectory_train_sample(prompts[t.prompt_index], t, advantage=1.0) for t in trajs]
    behav = torch.cat([s.behav_logp for s in samples])
    with torch.no_grad():
        lp_model = TokenLogprobModel(model)
        for packs in ([samples], [[s] for s in samples]):
            got = [lp_model({k: v for k, v in pack_samples(group).items() if k != "num_response_tokens"},
                            masked_token_ids=vision_token_ids(model)) for group in packs]
            torch.testing.assert_close(torch.cat(got), behav, atol=1e-5, rtol=0)
        for t, s in zip(trajs, samples):
            p = prompts[t.prompt_index]
            ids = torch.cat([p.input_ids, t.token_ids])[None]
            logits = model(ids, **_vision(p, t))[0].float()
            logp = _masked_log_softmax(model, logits[:-1]).gather(-1, ids[0, 1:, None])[:, 0]
            mask = torch.cat([torch.zeros(len(p), dtype=torch.bool), t.model_mask])[1:]
            torch.testing.assert_close(logp[mask], s.behav_logp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["tiny_qwen2_5_vl", "tiny_qwen3_vl"])
def test_replies_appended_together(kind, vqa, tmp_path):
    """Every token ends a turn: all conversations reply in the same iterations, so their new turns (images of
    two sizes) are prefilled in one padded forward; the log-probs still equal the training forward's."""
    model, prompts, trajs, session = rollout(kind, vqa, tmp_path, eos_every=1, n=2, kwargs={"sizes": [56, 84]})
    stats = session.engine_stats
    assert stats["append_calls"] == len(trajs) == 4 and stats["append_forwards"] < stats["append_calls"]
    assert stats["append_padded_rows"] > 0  # rows of different lengths (images of two sizes) in one forward
    assert len({int(t.vision["image_grid_thw"].prod()) for t in trajs}) == 2
    assert all(t.finish_reason == "done" and "pixel_values" in t.vision for t in trajs)
    _check_logprobs(model, prompts, trajs)


@pytest.mark.parametrize("kind", ["tiny_qwen2_5_vl", "tiny_qwen3_vl"])
def test_training_logprobs_equal_rollout_with_video_in_turn_two(kind, vqa, tmp_path):
    model, prompts, trajs, session = rollout(kind, vqa, tmp_path, env="rl_env_fns_for_tests:VideoSecondTurn", n=1)
    assert session.errors == 0 and all(t.finish_reason == "done" and t.num_turns == 2 for t in trajs)
    assert all("pixel_values_videos" in t.vision and t.vision["video_grid_thw"].shape[0] == 1 for t in trajs)
    assert all(int((t.token_ids[~t.model_mask] == model.args.video_token_id).sum()) > 0 for t in trajs)
    _check_logprobs(model, prompts, trajs)


@pytest.mark.parametrize("kind", ["tiny_qwen2_5_vl", "tiny_qwen3_vl"])
def test_training_logprobs_equal_rollout_with_image_in_turn_two(kind, vqa, tmp_path):
    model, prompts, trajs, session = rollout(kind, vqa, tmp_path)
    assert session.errors == 0
    assert len(trajs) == 4
    assert all(t.finish_reason == "done" and t.num_turns == 2 for t in trajs)
    image_token = model.args.image_token_id
    for t in trajs:  # the environment's image is in the trajectory, not trained, with its pixels
        env_part = t.token_ids[~t.model_mask]
        assert int((env_part == image_token).sum()) > 0
        assert "pixel_values" in t.vision and t.vision["image_grid_thw"].shape[0] == 1
        assert t.turn_rewards == [0.5, 1.0]
    # only the new tokens are prefilled after a turn: each environment turn plus the turn's last sampled token
    # (never fed to the model: the turn ended on it), once per conversation; the prompts once each
    stats = session.engine_stats
    assert stats["append_calls"] == len(trajs)
    assert stats["append_tokens"] == sum(int((~t.model_mask).sum()) + 1 for t in trajs)
    assert stats["prefill_calls"] == len(trajs)
    samples = [trajectory_train_sample(prompts[t.prompt_index], t, advantage=1.0) for t in trajs]
    behav = torch.cat([s.behav_logp for s in samples])
    with torch.no_grad():
        lp_model = TokenLogprobModel(model)
        for packs in ([samples], [[s] for s in samples]):  # several trajectories per pack, and one per pack
            got = []
            for group in packs:
                batch = pack_samples(group)
                labelled = int((batch["labels"] != IGNORE_INDEX).sum())
                assert labelled == batch.pop("num_response_tokens") == sum(int(s.response_mask.sum()) for s in group)
                got.append(lp_model(batch, masked_token_ids=vision_token_ids(model)))
            torch.testing.assert_close(torch.cat(got), behav, atol=1e-5, rtol=0)
        # independent reference: one cache-free forward per trajectory over all of its tokens and images
        for t, s in zip(trajs, samples):
            p = prompts[t.prompt_index]
            ids = torch.cat([p.input_ids, t.token_ids])[None]
            vision = _vision(p, t)
            logits = model(ids, **vision)[0].float()
            logp = _masked_log_softmax(model, logits[:-1]).gather(-1, ids[0, 1:, None])[:, 0]
            mask = torch.cat([torch.zeros(len(p), dtype=torch.bool), t.model_mask])[1:]
            torch.testing.assert_close(logp[mask], s.behav_logp, atol=1e-5, rtol=0)
