"""An error on ONE rank of a tensor-parallel vLLM engine inside a multi-turn rollout (an environment runner that
raises, a bad reply, a prompt check): the rank must not leave the loop alone while the other ranks step on into the
next forward's collective (a hang). The failing rank says so at the others' next agreement and all ranks raise
together. Two gloo ranks with a fake vLLM engine whose every step is a collective of the ranks (as a forward is);
a faulthandler deadline turns a hang into a failure."""
import faulthandler
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
from megatron_vlm.inference.multiturn import MultiTurnLimits, TurnChunk, TurnReply
from megatron_vlm.inference.vllm_engine import RankFailed, VLLMRolloutEngine
from megatron_vlm.inference.vllm_multiturn import VLLMMultiTurnRollout
from tests.integration.parallel.spawn import spawn

EOS = 0


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


class _FakeLLMEngine:
    """vLLM's LLMEngine of one rank: each step is a collective of the engine's ranks; every turn is two tokens,
    the second EOS (the model closes its turn: the environment answers)."""

    def __init__(self, group):
        self.group, self.reqs = group, {}

    def add_request(self, rid, prompt, max_tokens):
        self.reqs[rid] = (prompt, 0)

    def abort_request(self, ids):
        for rid in ids:
            self.reqs.pop(rid, None)

    def step(self):
        dist.all_reduce(torch.zeros(1), group=self.group)  # the forward's collective
        outs = []
        for rid, (prompt, k) in list(self.reqs.items()):
            tok = 5 if k == 0 else EOS
            done = k == 1
            self.reqs[rid] = (prompt, k + 1)
            if done:
                del self.reqs[rid]
            outs.append(SimpleNamespace(
                request_id=rid, prompt_token_ids=prompt if k == 0 else None, num_cached_tokens=0, finished=done,
                outputs=[SimpleNamespace(token_ids=[tok], logprobs=[{tok: SimpleNamespace(logprob=-1.0)}],
                                         finish_reason="stop" if done else None)]))
        return outs


class _Engine(VLLMRolloutEngine):
    """The real engine's step agreement (`give_up_at_step`, `leave_together`) on a gloo group of the ranks."""

    def __init__(self, tp_group, forward_group):  # not super().__init__: no vLLM
        self._tp_group = tp_group
        self._interrupt, self._pause, self._lock = threading.Event(), threading.Event(), threading.RLock()
        self.fake = _FakeLLMEngine(forward_group)
        self.max_model_len, self.eos_token_ids, self.policy_version = 64, [EOS], 0

    def generating(self):
        import contextlib

        @contextlib.contextmanager
        def cm():
            with self._lock:
                yield self.fake
        return cm()

    def add_request(self, engine, request_id, p, params, seed):
        engine.add_request(request_id, [int(t) for t in p.input_ids.tolist()], params.max_new_tokens)


class _Source:
    """Environments that answer every turn with one more token, for 3 turns; on `fail_rank` the second answer
    raises `fail` (a runner that broke, a reply the session cannot take); with `others_done` the other ranks' second
    answer ends every conversation (their loop ends at that step: the failure reaches their last agreement)."""

    def __init__(self, rank, fail_rank, fail, others_done=False):
        self.rank, self.fail_rank, self.fail, self.others_done, self.calls = rank, fail_rank, fail, others_done, 0

    def step(self, items):
        self.calls += 1
        if self.rank == self.fail_rank and self.calls == 2:
            raise self.fail
        if self.others_done and self.calls == 2:
            return [TurnReply(done=True, reward=1.0) for _ in items]
        return [TurnReply(chunk=TurnChunk(input_ids=torch.tensor([7])), reward=0.0) for _ in items]


CASES = [(False, False), (True, False), (False, True)]
"""(a stop check given, the other rank's loop ends at the failing step)."""


def _case(rank, abandon, others_done):
    tp = dist.new_group([0, 1], backend="gloo")
    forward = dist.new_group([0, 1], backend="gloo")
    rollout = VLLMMultiTurnRollout(_Engine(tp, forward), tokenizer=_Tokenizer())
    prompts = [RolloutPrompt(input_ids=torch.tensor([1, 2, 3]))]
    kw = {"abandon": (lambda: False)} if abandon else {}
    with pytest.raises(Exception) as err:
        rollout.generate(prompts, SamplingParams(max_new_tokens=4, n=2, temperature=1.0),
                         _Source(rank, 1, ValueError("the tool broke"), others_done),
                         MultiTurnLimits(max_turns=5, max_total_tokens=64), seed=0, **kw)
    if rank == 1:
        assert isinstance(err.value, ValueError) and "the tool broke" in str(err.value)
    else:
        assert isinstance(err.value, RankFailed) and "another rank" in str(err.value), repr(err.value)
    assert not rollout.engine.fake.reqs  # nothing of the call left in the engine
    # both ranks go on together: the next collective is the same one on both
    out = torch.tensor([float(rank)])
    dist.all_reduce(out)
    assert out.item() == 1.0


def _part(tmp, rank):
    faulthandler.dump_traceback_later(60, exit=True)  # a hang fails the test
    for abandon, others_done in CASES:
        _case(rank, abandon, others_done)
    faulthandler.cancel_dump_traceback_later()


def test_an_error_on_one_rank_raises_on_every_rank(tmp_path):
    """~15 s: one spawn of two ranks for all three cases."""
    spawn(tmp_path, _part)
