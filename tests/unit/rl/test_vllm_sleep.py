"""The vLLM engine's sleep-mode bookkeeping, against a recording stand-in for `vllm.LLM` (sleep mode needs CUDA,
so the real engine cannot sleep here). What is checked is our side of the contract vLLM 0.32 documents for
`LLM.sleep` / `LLM.wake_up`: level 1 offloads the weights (a wake brings them back), level 2 discards them (they
must be pushed again before the engine generates, and the push should wake the weights before the KV cache so
the peak stays low)."""
from __future__ import annotations

import threading

import pytest
import torch

from megatron_vlm.inference.vllm_engine import VLLMRolloutEngine
from megatron_vlm.rl.config import VLLMConfig


class _Engine:
    def has_unfinished_requests(self):
        return False

    def reset_encoder_cache(self):
        pass


class _RecordingLLM:
    """Records the calls the rollout engine makes; `weights` is what a push delivered (None after level 2)."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.llm_engine = _Engine()
        self.weights: dict | None = {"w": 0.0}
        self.offloaded: dict | None = None

    def sleep(self, level):
        self.calls.append(("sleep", level))
        self.offloaded = self.weights if level == 1 else None
        self.weights = None

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else None))
        if self.offloaded is not None and (tags is None or "weights" in tags):
            self.weights, self.offloaded = self.offloaded, None

    def collective_rpc(self, fn, args=()):
        (stream,) = args
        self.calls.append(("push",))
        self.weights = {k: float(v.sum()) for k, v in stream}

    def reset_prefix_cache(self, reset_running_requests=False):
        return True

    def reset_mm_cache(self):
        pass


def _engine(monkeypatch, level: int, *, sync: bool = True) -> tuple[VLLMRolloutEngine, _RecordingLLM]:
    monkeypatch.setattr("megatron_vlm.inference.vllm_weights.hf_weight_buckets",
                        lambda model, nbytes: [[("w", torch.full((2,), float(model.value)))]])
    e = VLLMRolloutEngine.__new__(VLLMRolloutEngine)  # the real constructor starts vLLM; only the bookkeeping is used
    e.cfg = VLLMConfig(sleep_mode=True, sleep_level=level)
    e.sync_from = type("Trainer", (), {"value": 3.0})() if sync else None
    e.llm = _RecordingLLM()
    e.asleep, e._weights_discarded = False, False
    e.policy_version, e._pushed_version = 0, None
    e.weight_push_s = e.weight_push_mb = 0.0
    e._lock = threading.RLock()
    return e, e.llm


def test_level_1_wakes_with_the_offloaded_weights_and_no_push(monkeypatch):
    e, llm = _engine(monkeypatch, 1)
    e.load_weights(None, version=1)
    llm.calls.clear()
    e.release_memory()
    e._wake()
    assert llm.calls == [("sleep", 1), ("wake_up", None)]
    assert llm.weights == {"w": 6.0}
    e.load_weights(None, version=1)  # same version: already in, nothing pushed
    assert llm.calls[-1] == ("wake_up", None)


def test_level_2_refills_the_weights_before_generating_at_the_same_version(monkeypatch):
    e, llm = _engine(monkeypatch, 2)
    e.load_weights(None, version=1)
    llm.calls.clear()
    e.release_memory()
    assert llm.weights is None
    e._wake()  # e.g. an update that made no optimizer step: the version did not move, the weights are gone
    assert llm.calls == [("sleep", 2), ("wake_up", ("weights",)), ("push",), ("wake_up", ("kv_cache",))]
    assert llm.weights == {"w": 6.0} and not e.asleep
    assert e.policy_version == 1


def test_level_2_push_of_a_new_version_wakes_weights_first(monkeypatch):
    e, llm = _engine(monkeypatch, 2)
    e.load_weights(None, version=1)
    e.release_memory()
    llm.calls.clear()
    e.sync_from.value = 5.0
    e.load_weights(None, version=2)
    assert llm.calls == [("wake_up", ("weights",)), ("push",), ("wake_up", ("kv_cache",))]
    assert llm.weights == {"w": 10.0}
    e._wake()
    assert llm.calls[-1] == ("wake_up", ("kv_cache",))  # awake already: nothing more


def test_level_2_without_a_trainer_to_refill_from_fails_instead_of_generating_garbage(monkeypatch):
    e, llm = _engine(monkeypatch, 2, sync=False)
    e.load_weights({"w": torch.ones(2)}, version=1)
    e.release_memory()
    with pytest.raises(RuntimeError, match="level 2"):
        e._wake()
    e.load_weights({"w": torch.ones(3)}, version=2)  # an explicit push (the asynchronous rollout ranks) refills
    assert llm.weights == {"w": 3.0} and not e.asleep


def test_sleep_mode_off_never_sleeps(monkeypatch):
    e, llm = _engine(monkeypatch, 1)
    e.cfg = VLLMConfig()
    e.release_memory()
    e._wake()
    assert llm.calls == []
