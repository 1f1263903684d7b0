"""The weight push of asynchronous GRPO into a running rollout engine (in one process: a stand-in
bridge hands over the tensors a broadcast would deliver): generation started with version 0 is paused
at a token boundary, the new weights are written into the engine's model in place, and it goes on —
the completions carry version 0 then version 1 (never back), and the tokens drawn after the switch
follow the new weights. The new weights are a zero LM head, so their distribution is uniform: a
behaviour log-prob of exactly -log(vocabulary size) per token, which the random old weights never give.

Also the trainer's per-token staleness check, which must refuse a token older than the bound."""
import math
import threading

import pytest
import torch

from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
from megatron_vlm.models import build_model
from megatron_vlm.rl.asynchronous.trainer import AsyncGRPOLoopStep, StalenessError
from megatron_vlm.rl.asynchronous.weights import push_weights, receive_weights
from tests.fixtures import tiny_qwen2_5_vl as F


class DigitsTokenizer:
    pad_token_id = F.PAD_TOKEN_ID
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"{int(i)}|" for i in ids)


class LoopbackBridge:
    """Records what the trainer side sends; replays it to the receiving side."""

    def __init__(self):
        self.objects, self.tensors, self.replaying = [], [], False

    def broadcast_object(self, obj=None):
        if obj is not None:
            self.objects.append(obj)
            return obj
        return self.objects.pop(0)

    def broadcast_tensor_(self, tensor, what=""):
        if self.objects and len(self.tensors) < len(self.objects[-1]["names"]) and not self.replaying:
            self.tensors.append(tensor.clone())
        else:
            tensor.copy_(self.tensors.pop(0))


def test_generation_switches_to_pushed_weights_at_a_token_boundary():
    torch.manual_seed(0)
    rollout = build_model(F.tiny_qwen2_5_vl_config_dict()).eval().requires_grad_(False)
    trainer = build_model(F.tiny_qwen2_5_vl_config_dict())
    trainer.load_state_dict(rollout.state_dict())
    with torch.no_grad():
        trainer.lm_head.weight.zero_()
    engine = PolicyRolloutEngine(rollout, DigitsTokenizer(), EngineOptions(eos_token_ids=[-1]))
    vocab = trainer.lm_head.weight.shape[0]
    # behaviour log-probs are of the distribution drawn from: uniform over the ids other than the suppressed vision ones
    uniform = -math.log(vocab - len(engine.suppress_token_ids))

    # trainer side: the push of the lm head as version 1 (recorded by the loopback)
    bridge = LoopbackBridge()
    push_weights(trainer, bridge, 1, names=["lm_head.weight"])
    header = bridge.objects[-1]
    assert [n for n, _, _ in header["names"]] == ["lm_head.weight"] and len(bridge.tensors) == 1

    calls, reached = [0], threading.Event()

    def count(*_):
        calls[0] += 1
        if calls[0] == 4:
            reached.set()

    rollout.register_forward_hook(count)
    g = torch.Generator().manual_seed(1)
    prompts = [RolloutPrompt(torch.tensor(F.build_sample(p, g)["input_ids"])) for p in ([2, 3, 4], [5, 1])]
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("r", engine.generate(
        prompts, SamplingParams(max_new_tokens=48, n=2, temperature=1.0), generator=torch.Generator().manual_seed(3))))
    worker.start()
    assert reached.wait(60)
    bridge.replaying = True
    receive_weights(rollout, bridge, header, engine)
    worker.join(120)
    assert torch.equal(rollout.lm_head.weight, torch.zeros_like(rollout.lm_head.weight))
    assert engine.policy_version == 1
    for s in out["r"].samples:
        v = s.token_versions
        assert v.numel() == 48 and v[0] == 0 and v[-1] == 1, v  # started on version 0, ended on version 1
        assert bool((v[1:] >= v[:-1]).all()), v  # never back to an older version
        first_new = int((v == 1).nonzero()[0])
        old, new = s.logprobs[:first_new], s.logprobs[first_new + 1:]
        # the token sampled at the switch comes from logits of the step before it (the engine labels it with
        # the version current when it is drawn); from the next one on, the new weights decide
        assert torch.allclose(new, torch.full_like(new, uniform), atol=1e-5), (new, uniform)
        assert not torch.allclose(old, torch.full_like(old, uniform), atol=1e-3)


def _step(k):
    step = AsyncGRPOLoopStep.__new__(AsyncGRPOLoopStep)
    step.k = k
    return step


def _payload(versions):
    return [{"samples": [{"token_versions": torch.tensor(v, dtype=torch.long)} for v in versions]}]


def test_staleness_check_counts_lag_and_refuses_older_tokens():
    m = _step(2)._staleness(5, _payload([[3, 4, 4], [5, 5], []]))
    assert m["async/version_lag_max"] == 2 and m["async/interrupted_samples"] == 1 and m["async/samples"] == 3
    assert m["async/version_lag_mean"] == pytest.approx((2 + 1 + 1 + 0 + 0) / 5)
    with pytest.raises(StalenessError, match="max_head_offpolicyness = 2"):
        _step(2)._staleness(5, _payload([[2, 4]]))
    with pytest.raises(StalenessError):
        _step(0)._staleness(1, _payload([[1, 0 + 1, 0]]))
