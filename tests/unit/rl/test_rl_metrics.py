"""GRPO step metrics: statistics against the statistics module, accuracy threshold, token-weighted
reduction of loss metrics over micro-batches, and the phase timer's bookkeeping."""
import statistics

import pytest
import torch

from megatron_vlm.rl.losses import policy_loss
from megatron_vlm.rl.metrics import PhaseTimer, length_metrics, reduce_loss_metrics, reward_metrics


def test_reward_metrics():
    total = [1.1, 0.0, 1.0, 0.1]
    per = {"math": [1.0, 0.0, 1.0, 0.0], "format": [1.0, 0.0, 0.0, 1.0]}
    m = reward_metrics(total, per, accuracy_label="math")
    assert m["reward/mean"] == pytest.approx(statistics.mean(total))
    assert m["reward/std"] == pytest.approx(statistics.stdev(total))
    assert (m["reward/min"], m["reward/max"]) == (0.0, 1.1)
    assert m["reward/math"] == 0.5 and m["reward/format"] == 0.5 and m["accuracy"] == 0.5
    assert reward_metrics(total, {"math": [0.6, 0.4, 0.9, 0.0]}, accuracy_label="math", threshold=0.5)["accuracy"] == 0.5
    with pytest.raises(ValueError, match="accuracy_label"):
        reward_metrics(total, per, accuracy_label="nope")


def test_length_metrics():
    m = length_metrics([10, 20, 30], [False, False, True])
    assert m["response_length/mean"] == 20 and m["response_length/max"] == 30
    assert m["response_length/truncated_frac"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="truncated"):
        length_metrics([1, 2], [True])


def test_reduce_loss_metrics_weights_by_tokens():
    # two micro-batches of 3 and 1 tokens: the token-weighted mean equals the metric of the whole batch
    lp = torch.tensor([[-1.0, -0.5, -2.0, -0.1]])
    old = torch.tensor([[-1.6, -0.5, -1.5, -0.1]])
    adv = torch.tensor([1.0])
    ent = torch.tensor([[1.0, 2.0, 3.0, 10.0]])
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.2)
    whole = policy_loss(lp, old, adv, torch.ones(1, 4, dtype=torch.bool), entropy=ent, **kw)
    a = policy_loss(lp[:, :3], old[:, :3], adv, torch.ones(1, 3, dtype=torch.bool), entropy=ent[:, :3], **kw)
    b = policy_loss(lp[:, 3:], old[:, 3:], adv, torch.ones(1, 1, dtype=torch.bool), entropy=ent[:, 3:], **kw)
    m = reduce_loss_metrics([a, b])
    assert m["actor/num_tokens"] == 4
    for k in ("clip_frac", "entropy", "ratio_mean"):
        assert m[f"actor/{k}"] == pytest.approx(whole.metrics[k].item())


def test_phase_timer(monkeypatch):
    clock = iter([0.0, 2.0, 2.0, 2.5, 10.0, 11.0])
    monkeypatch.setattr("megatron_vlm.rl.metrics.time.perf_counter", lambda: next(clock))
    t = PhaseTimer()
    with t.phase("rollout"):
        pass
    with t.phase("reward"):
        pass
    with t.phase("rollout"):
        pass
    m = t.metrics(tokens={"rollout": 300, "train": 50})
    assert m["time/rollout_s"] == 3.0 and m["time/reward_s"] == 0.5 and m["time/step_s"] == 3.5
    assert m["perf/rollout_tokens_per_s"] == 100.0 and "perf/train_tokens_per_s" not in m
    t.reset()
    assert t.metrics() == {"time/step_s": 0}
