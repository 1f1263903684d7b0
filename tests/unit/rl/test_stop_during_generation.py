"""A stop signal (SIGTERM / SIGUSR1) while a GRPO step generates its completions or scores them with a model reward
(a reward model, a generative judge: in-process, not waited for in the reward pool).

Neither asked the stop flag: a long generation (a large `max_new_tokens`, a slow decode) or a long model scoring ran
to its end before the step boundary saw the stop, past the scheduler's warning, and the stop's checkpoint was lost.
Now the built-in engine asks the check between decode steps and the model reward between its packed forwards, and
gives up once the stop has been pending `ABANDON_GRACE_S` (`WaitAbandoned`, then `StepAbandoned` agreed by every
rank, as for a hung verifier). Lock-stepped ranks (the trainer's FSDP forward, the expert-parallel copy: a
collective in every forward) agree inside the decode step's existing all-reduce, so that all leave at the same
step."""
from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_vlm import abandon
from megatron_vlm.abandon import Patience, WaitAbandoned
from megatron_vlm.inference.engine import SamplingParams
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
from megatron_vlm.parallel.collectives import all_reduce_max
from megatron_vlm.training.signals import StepAbandoned, StopFlag
from tests.fixtures.rollout_engine import SilentTokenizer, tiny_vl_model_and_prompts

GRACE_S = 0.3
LONG = 600
"""A budget of decode steps that, slowed down, takes far longer than the test's bound."""


@pytest.fixture
def short_grace(monkeypatch):
    monkeypatch.setattr(abandon, "ABANDON_GRACE_S", GRACE_S)


def _slowed(engine: PolicyRolloutEngine, seconds: float) -> PolicyRolloutEngine:
    """Each decode step of `engine` takes `seconds` more (a long generation on a slow device)."""
    decode = engine._decode

    def slow(*a, **k):
        time.sleep(seconds)
        return decode(*a, **k)

    engine._decode = slow  # type: ignore[method-assign]
    return engine


def test_a_stopping_rank_gives_up_its_generation_between_decode_steps(short_grace):
    model, prompts = tiny_vl_model_and_prompts(2)
    params = SamplingParams(max_new_tokens=LONG, n=2, temperature=0.0)
    engine = _slowed(PolicyRolloutEngine(model, SilentTokenizer(), EngineOptions(eos_token_ids=[-1])), 0.02)
    assert engine.takes_abandon
    t0 = time.monotonic()
    with pytest.raises(WaitAbandoned, match="decode steps") as e:
        engine.generate(prompts, params, abandon=lambda: True)
    assert e.value.waited_for == "generation"
    assert time.monotonic() - t0 < GRACE_S + 2.0  # not the LONG x 0.02 s of the whole generation
    # the engine generates again afterwards, and a check that never says stop changes nothing
    short = SamplingParams(max_new_tokens=4, n=2, temperature=0.0)
    want = engine.generate(prompts, short)
    got = engine.generate(prompts, short, abandon=lambda: False)
    assert [s.token_ids.tolist() for s in got.samples] == [s.token_ids.tolist() for s in want.samples]


def _lockstep_rank(rank: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    model, prompts = tiny_vl_model_and_prompts(2)
    cpu = torch.device("cpu")
    steps: list[int] = []

    def forward(**kw):  # a collective in every forward, as the FSDP root's: the ranks must make the same calls
        steps.append(1)
        dist.all_reduce(torch.zeros(1))
        return model(**kw)

    engine = _slowed(PolicyRolloutEngine(model, SilentTokenizer(), EngineOptions(eos_token_ids=[-1]), forward=forward,
                                         all_ranks_active=lambda flags: all_reduce_max([int(flags)], cpu)[0]), 0.02)
    # only rank 0 is stopping (the signal reached it alone)
    check = (lambda: True) if rank == 0 else (lambda: False)
    t0 = time.monotonic()
    why = ""
    try:
        engine.generate(prompts[rank:rank + 1], SamplingParams(max_new_tokens=LONG, n=2, temperature=0.0),
                        abandon=check)
    except WaitAbandoned as e:
        why = f"{e.waited_for}: {e}"
    dist.all_reduce(torch.zeros(1))  # both ranks' collectives still match after it
    Path(f"{out}.{rank}").write_text(json.dumps({"why": why, "took": time.monotonic() - t0, "forwards": len(steps)}))
    dist.destroy_process_group()


def test_lockstepped_ranks_give_up_their_generation_at_the_same_decode_step(tmp_path, short_grace):
    out = str(tmp_path / "res")
    fork = mp.get_context("fork")  # the ranks start in a moment (no imports); they use no device
    procs = [fork.Process(target=_lockstep_rank, args=(r, str(tmp_path / "store"), out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=20)
        assert not any(p.is_alive() for p in procs), "a rank still generates"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    r0, r1 = (json.loads(Path(f"{out}.{r}").read_text()) for r in range(2))
    assert r0["why"].startswith("generation: generation given up after"), r0
    assert r1["why"] == "generation: generation given up: another rank is stopping", r1
    assert r0["forwards"] == r1["forwards"] < LONG, (r0, r1)
    assert max(r0["took"], r1["took"]) < GRACE_S + 5.0, (r0, r1)


# ---------------------------------------------------------------------------------------- the step


class _LongEngine:
    """A rollout engine whose generation runs `seconds` unless its stop check gives it up (as the built-in engine's
    between decode steps)."""

    takes_abandon = True

    def __init__(self, inner, seconds: float):
        self.inner, self.seconds = inner, seconds

    def load_weights(self, weights, version):
        pass

    def release_memory(self):
        pass

    def generate(self, prompts, params, generator=None, abandon=None):
        give_up = Patience(abandon) if abandon is not None else None
        end = time.monotonic() + self.seconds
        while time.monotonic() < end:
            if give_up is not None and give_up():
                raise WaitAbandoned("generation given up: the rank is stopping", waited_for="generation")
            time.sleep(0.02)
        return self.inner.generate(prompts, params, generator=generator)


def test_a_step_stopped_while_it_generates_is_abandoned(short_grace):
    from megatron_vlm.rl.grpo_step import GRPOStep
    from megatron_vlm.training.optim import OptimState
    from tests.unit.rl.test_grpo_step_algorithms import Encoder, Engine, TinyPolicy, _pool, _rl
    from tests.unit.rl.test_stop_during_step import HungManager

    rl = _rl()
    torch.manual_seed(0)
    policy = TinyPolicy()
    before = [p.detach().clone() for p in policy.parameters()]
    opt = torch.optim.AdamW(policy.parameters(), lr=0.05)
    stop = StopFlag()
    stop.signum = 15
    ctx = NS(env=NS(device=torch.device("cpu"), rank=0, world_size=1), stop=stop,
             cfg=NS(data=NS(max_tokens_per_pack=64), train=NS(seed=3, max_grad_norm=0.0)), to_device=lambda b: b)
    bundle = NS(dims=NS(dp_size=1, dp_rank=0), wrapper=policy, trainable_params=list(policy.parameters()),
                moe_balancer=None)
    pool = _pool(8)
    engine = _LongEngine(Engine(rl.batch.group_size, rl.rollout.max_new_tokens), seconds=8.0)
    grpo = GRPOStep(ctx, bundle, OptimState(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)), rl, engine,
                    Encoder(), HungManager(hang=False))
    t0 = time.monotonic()
    with pytest.raises(StepAbandoned, match="this rank gave up waiting for its generation"):
        grpo.run(0, pool[:4], prompt_pool=pool)
    assert time.monotonic() - t0 < GRACE_S + 3.0
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))


# ---------------------------------------------------------------------------------------- model rewards


class _SlowModel(torch.nn.Module):
    """A reward model whose packed forward takes `seconds` more."""

    def __init__(self, inner, seconds: float):
        super().__init__()
        self.inner, self.seconds, self.calls = inner, seconds, 0
        self.score, self.backbone = inner.score, inner.backbone

    def forward(self, batch):
        self.calls += 1
        time.sleep(self.seconds)
        return self.inner(batch)


def test_a_stopping_rank_gives_up_its_model_reward_between_packed_forwards(tmp_path, short_grace):
    from megatron_vlm.rl.rewards.combined import CombinedRewards
    from megatron_vlm.rl.rewards.config import ModelRewardConfig
    from megatron_vlm.rl.rewards.model_reward import ModelRewardScorer
    from megatron_vlm.rl.rewards.score_model import load_score_model
    from tests.unit.rl.test_reward_model import PROMPTS, _hf_seqcls_folder

    _hf_seqcls_folder(tmp_path, "qwen2", num_labels=1)
    cfg = ModelRewardConfig(path=str(tmp_path), name="rm", batch_size=1)
    slow = _SlowModel(load_score_model(tmp_path), 0.1)
    scorer = ModelRewardScorer(cfg, model=slow)
    n = 60  # 60 forwards of 0.1 s: 6 s unless given up
    with CombinedRewards([cfg], scorers={0: scorer}) as rewards:
        t0 = time.monotonic()
        with pytest.raises(WaitAbandoned, match="reward model") as e:
            rewards.score(["x"] * n, [""] * n, [PROMPTS[0]] * n, abandon=lambda: True)
        assert e.value.waited_for == "reward models"
        assert time.monotonic() - t0 < GRACE_S + 1.5 and slow.calls < n
        assert rewards.metrics().get("reward/calls", 0) == 0  # nothing of the given-up batch counted
        # a check that never says stop scores as before
        assert rewards.score(["x"], [""], [PROMPTS[0]], abandon=lambda: False).errors == 0


def test_a_stopping_rank_gives_up_its_multi_turn_generation_between_decode_steps(short_grace):
    from megatron_vlm.inference.multiturn import MultiTurnLimits, MultiTurnRollout

    class NoEnvironment:
        def step(self, items):
            raise AssertionError("no model turn ends in this test")

    model, prompts = tiny_vl_model_and_prompts(2)
    engine = PolicyRolloutEngine(model, SilentTokenizer(), EngineOptions(eos_token_ids=[-1]))
    loop = MultiTurnRollout(engine)
    logits = loop._logits

    def slow(*a, **k):  # LONG decode steps of 0.02 s unless given up
        time.sleep(0.02)
        return logits(*a, **k)

    loop._logits = slow
    assert loop.takes_abandon
    t0 = time.monotonic()
    with pytest.raises(WaitAbandoned, match="decode steps") as e:
        loop.generate(prompts, SamplingParams(max_new_tokens=LONG, n=2, temperature=0.0), NoEnvironment(),
                      MultiTurnLimits(max_turns=2, max_total_tokens=LONG + 64), abandon=lambda: True)
    assert e.value.waited_for == "generation" and time.monotonic() - t0 < GRACE_S + 2.0
