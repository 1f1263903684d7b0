"""A rollout rank whose scoring fails must end with the error, not wait for the trainer.

The trainer waits for the step's samples from that rank, and the rank's weight thread waits for the trainer's
next control message: if the rank's main thread joins the weight thread after the scoring thread failed, both
sides wait for each other (once until the bridge's 30-minute timeout; now as long as both processes live) before the
job ends. The rank must raise the scoring error at once, so its process exits, torchrun ends the job and the trainer's
wait fails once the rank's heartbeat is gone."""
from __future__ import annotations

import threading
import types

import torch

from megatron_vlm.inference.engine import RolloutResult, RolloutSample
from megatron_vlm.rl.asynchronous import rollout_rank as rr
from megatron_vlm.rl.asynchronous.allocation import Allocation
from megatron_vlm.rl.asynchronous.bridge import Role


class _TrainerWaitingForSamples:
    """The bridge as a rollout rank sees it while the trainer waits for samples: the hello, the first push, then
    nothing more (the trainer's next control message comes only after this rank's samples)."""

    def __init__(self):
        self.messages = [{"kind": "hello", "start_step": 0, "total_steps": 3, "num_prompts": 4},
                         {"kind": "weights", "version": 0, "names": []}, {"kind": "want", "step": 0}]
        self.never = threading.Event()

    def broadcast_object(self, obj=None):
        if self.messages:
            return self.messages.pop(0)
        self.never.wait()  # a gloo broadcast with no sender: blocks until the bridge's timeout
        raise RuntimeError("bridge timeout")

    def send_object(self, obj, dst=0):
        raise AssertionError("no samples are sent after scoring failed")


class _Engine:
    policy_version = 0
    kv_block_size = 0

    def generate(self, prompts, params, generator=None):
        samples = [RolloutSample(prompt_index=p, sample_index=j, token_ids=torch.tensor([5]), logprobs=torch.tensor([-1.0]),
                                 text="x", finish_reason="stop", prompt_length=1, token_versions=torch.tensor([0]))
                   for p in range(len(prompts)) for j in range(params.n)]
        return RolloutResult(samples=samples, seconds=0.01)

    def interrupt(self):
        pass

    def close(self):
        pass


class _FailingRewards:
    def __init__(self, *a, **k):
        pass

    def score(self, *a, **k):
        raise RuntimeError("reward pool broke")

    def metrics(self):
        return {}

    def close(self):
        pass


def _prompt(i):
    return types.SimpleNamespace(prompt_id=str(i), answer="1", problem="p", metadata=None)


def rollout_rank_context(monkeypatch, tmp_path, rewards=None):
    """A rollout rank's context with every heavy part (processor, prompts, model, engine, rewards) a stand-in."""
    train = [_prompt(i) for i in range(4)]
    rl = types.SimpleNamespace(
        rollout_backend="builtin", env=None, rewards=[],
        rollout=types.SimpleNamespace(max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, stop=[], batch_prompts=2,
                                      memory_gib=1.0, cuda_graphs="off"),
        batch=types.SimpleNamespace(group_size=2, prompts_per_step=2),
        reward_pool=types.SimpleNamespace(timeout_s=1, workers=1, memory_limit_mb=0, batch_timeout_s=1, abs_max=1),
        asynchronous=types.SimpleNamespace(max_head_offpolicyness=1))
    cfg = types.SimpleNamespace(rl=rl, train=types.SimpleNamespace(precision="fp32", seed=0),
                                model=types.SimpleNamespace(dtype="float32", path="m"), data=types.SimpleNamespace(
                                    min_pixels=None, max_pixels=None, video_min_pixels=None, video_max_pixels=None,
                                    chat_template_kwargs={},
                                    max_frames=1, fps=1.0, max_tokens_per_pack=64))
    ctx = types.SimpleNamespace(cfg=cfg, env=types.SimpleNamespace(device=torch.device("cpu")), run_dir=tmp_path,
                                stop=types.SimpleNamespace(signum=0))
    monkeypatch.setattr(rr, "require_rl", lambda c: c.rl)
    monkeypatch.setattr(rr, "load_processor", lambda *a, **k: types.SimpleNamespace(tokenizer=None))
    monkeypatch.setattr(rr, "load_prompt_sets", lambda *a, **k: types.SimpleNamespace(train=train))
    monkeypatch.setattr(rr, "drop_unusable_prompts", lambda sets, *a: sets)
    monkeypatch.setattr(rr.MediaLimits, "from_config", staticmethod(lambda d: None))
    monkeypatch.setattr(rr, "PromptEncoder", lambda *a, **k: types.SimpleNamespace(
        encode=lambda s: types.SimpleNamespace(input_ids=torch.tensor([1, 2])), skipped=0))
    monkeypatch.setattr(rr, "load_hf_model", lambda *a, **k: torch.nn.Linear(1, 1))
    monkeypatch.setattr(rr, "PolicyRolloutEngine", lambda *a, **k: _Engine())
    monkeypatch.setattr(rr, "paged_kv_kwargs", lambda rl: {})
    monkeypatch.setattr(rr, "receive_weights", lambda *a, **k: 0.0)
    monkeypatch.setattr(rr, "RewardManager", rewards or _FailingRewards)
    return ctx


def test_a_scoring_failure_ends_the_rollout_rank_with_the_error(monkeypatch, tmp_path):
    ctx = rollout_rank_context(monkeypatch, tmp_path)
    bridge = _TrainerWaitingForSamples()
    role = Role(name="rollout", rank=0, allocation=Allocation(rollout=1, train=1), global_rank=1, bridge=bridge)
    out: dict = {}

    def run():
        try:
            out["code"] = rr.run_rollout_rank(ctx, role)
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=5)
    bridge.never.set()  # release a hung weight thread so the test process ends cleanly
    assert not t.is_alive() or "error" in out, "the rollout rank waited for the trainer after its scoring failed"
    t.join(timeout=5)
    assert "reward pool broke" in str(out.get("error")), out
