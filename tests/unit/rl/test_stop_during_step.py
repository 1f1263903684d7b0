"""A stop signal (SIGTERM / SIGUSR1) that arrives while a GRPO step waits on a hung reward batch or environment turn.

The wait used to notice nothing until `rl.reward_pool.batch_timeout_s` (300 s by default, more than the 180 s the
shipped sbatch leaves before SIGKILL), so the stop's checkpoint was lost. Now the wait asks the stop flag
(`StopFlag.pending`) and gives up once it has gone on `ABANDON_GRACE_S` with a stop pending (`WaitAbandoned`); a
batch that ends within the grace is kept. Every rank agrees to abandon the step (`StepAbandoned`), nothing
of it is applied, and the loop saves the state of the step's start and exits 143. Here: the pools, the agreement of
two gloo ranks one of which hangs, the loop, and the asynchronous trainer / rollout rank's ends of it. The whole jobs
are in tests/integration/test_grpo_stop_hung_step.py."""
from __future__ import annotations

import os
import queue
import signal
import threading
import time
from datetime import timedelta
from types import SimpleNamespace as NS

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_vlm.abandon import ABANDON_GRACE_S, Patience, WaitAbandoned
from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.rl.asynchronous import rollout_rank as rr
from megatron_vlm.rl.asynchronous.trainer import AsyncGRPOLoopStep
from megatron_vlm.rl.env.pool import EnvCall, EnvWorkerPool, InlineEnvRunner
from megatron_vlm.rl.rewards.config import CustomRewardConfig
from megatron_vlm.rl.rewards.manager import RewardManager
from megatron_vlm.training.loop import EXIT_STOPPED, run_loop
from megatron_vlm.training.signals import EvaluationAbandoned, StepAbandoned, StopFlag, StopRequested

REWARD_FNS = "rl_reward_fns_for_tests"
ENV_FNS = "rl_env_fns_for_tests"


def _after(seconds: float):
    """A stop check that says "stop" `seconds` from now (a signal pending that long)."""
    at = time.monotonic() + seconds
    return lambda: time.monotonic() >= at


def test_a_hung_reward_batch_is_given_up_when_the_rank_stops():
    with RewardManager([CustomRewardConfig(name="r", function=f"{REWARD_FNS}.hang")], timeout_s=120.0,
                       num_workers=1, batch_timeout_s=120.0) as manager:
        t0 = time.monotonic()
        with pytest.raises(WaitAbandoned):
            manager.score(["fine", "hang", "fine"], ["", "", ""], abandon=_after(0.5))
        assert time.monotonic() - t0 < 0.5 + ABANDON_GRACE_S + 2.0
        assert manager.metrics()["reward/calls"] == 0  # nothing of the abandoned batch counted
        assert manager.pool.restarts == 0  # the hung worker was ended, not counted as a failure
        # a new worker answers the next batch, and one that ends within the grace is kept though a stop is pending
        assert manager.score(["fine"], [""], abandon=lambda: True).total == [1.0]


def test_an_evaluation_job_stopped_in_a_hung_batch_ends_its_workers_at_once():
    """train.mode = "eval" runs inside `StopFlag.interrupting()`: SIGTERM raises StopRequested out of the hung wait at
    once, and closing the pool (jobs.py `run_eval`'s finally) must not hold the stop: it joined each busy worker 2 s
    before killing it, 8 s for 4 hung workers (2 s x eval.reward_workers)."""
    flag = StopFlag().install()
    try:
        with RewardManager([CustomRewardConfig(name="r", function=f"{REWARD_FNS}.hang")], timeout_s=120.0,
                           num_workers=4) as manager:
            manager.pool.start()
            procs = [w.proc for w in manager.pool._workers]
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
            t0 = time.monotonic()
            with pytest.raises(StopRequested), flag.interrupting():
                manager.score(["hang"] * 8, [""] * 8)
            raised, t1 = time.monotonic() - t0, time.monotonic()
        closed = time.monotonic() - t1
    finally:
        flag.restore()
    assert raised < 3.0 and closed < 1.5, (raised, closed)
    assert not any(p.is_alive() for p in procs)


def test_a_hung_environment_turn_is_given_up_when_the_rank_stops():
    with EnvWorkerPool(num_workers=1, timeout_s=120.0, preload=(f"{ENV_FNS}:Hang",)) as pool:
        pool.start()
        (reset,) = pool.run([EnvCall("reset", name=f"{ENV_FNS}:Hang")])
        assert not reset.error
        t0 = time.monotonic()
        with pytest.raises(WaitAbandoned) as info:
            pool.run([EnvCall("step", state=reset.state, action="hi")], abandon=_after(0.5))
        assert time.monotonic() - t0 < 0.5 + ABANDON_GRACE_S + 2.0
    # what was waited on is named: the environments (this pool is the reward pool's), not "calls"
    assert info.value.waited_for == "environments", info.value.waited_for
    assert str(info.value) == "1 environment call given up: the rank is stopping"


@pytest.mark.parametrize("env", ["SleepFor", "SpinFor"])
def test_a_hung_in_process_environment_call_is_given_up_when_the_rank_stops(env):
    """[rl.env] sandbox = false: the call runs on this (the main) thread. It used to be checked only between calls, so
    a hung one held the stop; now it is interrupted once the stop has been pending ABANDON_GRACE_S, whether it waits in
    a system call or computes in Python."""
    runner = InlineEnvRunner()
    (reset,) = runner.run([EnvCall("reset", name=f"{ENV_FNS}:{env}", kwargs={"seconds": 8.0})])
    t0 = time.monotonic()
    with pytest.raises(WaitAbandoned) as info:
        runner.run([EnvCall("step", state=reset.state, action="hi")], abandon=_after(0.5))
    took = time.monotonic() - t0
    assert took < 0.5 + ABANDON_GRACE_S + 1.5, took
    assert info.value.waited_for == "environments" and str(info.value).startswith("1 environment call given up")
    # a call that ends within the grace is kept though a stop is pending; one with no stop is not interrupted
    (quick,) = runner.run([EnvCall("reset", name=f"{ENV_FNS}:{env}", kwargs={"seconds": 0.3})])
    (done,) = runner.run([EnvCall("step", state=quick.state, action="hi")], abandon=lambda: True)
    assert not done.error and done.result is not None and done.result.done
    (done,) = runner.run([EnvCall("step", state=quick.state, action="hi")], abandon=lambda: False)
    assert not done.error and done.result is not None and done.result.done
    os.kill(os.getpid(), signal.SIGUSR2)  # a SIGUSR2 outside a call (one late, or not the watcher's) raises nothing
    time.sleep(0.05)


def test_the_abandoned_step_names_what_its_rank_waited_for():
    """A multi-turn round gives up its verifiers' wait (its environments answered) or its environments' wait: the
    message names the one that hung, not "environments or verifiers" whatever was interrupted."""
    from megatron_vlm.rl.data_shards import DataShards
    from megatron_vlm.rl.metrics import PhaseTimer
    from megatron_vlm.rl.rounds import RoundSampler
    from tests.unit.rl.test_grpo_step_algorithms import Encoder, Engine, _pool, _rl

    rl = _rl()
    engine = Engine(rl.batch.group_size, rl.rollout.max_new_tokens)

    class Conversations:
        """A multi-turn rollout whose environments answer (`env` None) or hang in `env`, a real pool."""

        def __init__(self, env=None):
            self.env = env

        def generate(self, shard, params, seed, abandon=None):
            if self.env is not None:
                (reset,) = self.env.run([EnvCall("reset", name=f"{ENV_FNS}:Hang")])
                self.env.run([EnvCall("step", state=reset.state, action="hi")], abandon=abandon)
            return engine.generate(shard.prompts, params), []

    def abandoned(manager, multiturn):
        sampler = RoundSampler(rl, engine, Encoder(), manager, shards=DataShards.of(NS(dp_size=1), 0, torch.device("cpu")),
                               seed=0, multiturn=multiturn, stop_check=_after(0.0))
        with pytest.raises(StepAbandoned) as info:
            sampler.sample_round(0, 0, _pool(4), PhaseTimer())
        return str(info.value)

    why = abandoned(HungManager(hang=True), Conversations())
    assert why.startswith("this rank gave up waiting for its verifiers: "), why
    with EnvWorkerPool(num_workers=1, timeout_s=120.0, preload=(f"{ENV_FNS}:Hang",)) as pool:
        why = abandoned(HungManager(hang=False), Conversations(pool))
    assert why == "this rank gave up waiting for its environments: 1 environment call given up: the rank is stopping", why


def test_a_wait_gives_up_only_after_its_grace_with_a_stop_pending():
    flag = StopFlag()
    give_up = Patience(flag.pending, grace_s=0.3)
    assert not give_up()
    flag._handle(15, None)
    assert flag.pending() and not give_up()  # the stop just seen: the wait goes on a moment
    time.sleep(0.35)
    assert give_up()
    assert not Patience(flag.pending, grace_s=0.3)()  # the grace counts per wait


# ---------------------------------------------------------------------------------------- the ranks agree

class HungManager:
    """The reward manager's contract with a wait that hangs (rank 0): it gives up when the stop check says so, or
    returns every reward 0 after `deadline_s` (the pool's batch deadline)."""

    labels = ["exact_match"]

    def __init__(self, hang: bool, deadline_s: float = 30.0):
        self.hang, self.deadline_s = hang, deadline_s

    def metrics(self):
        return {}

    def score(self, texts, answers, prompts, metadata, abandon=None, **kw):
        end = time.monotonic() + (self.deadline_s if self.hang else 0.0)
        while time.monotonic() < end:
            if abandon is not None and abandon():
                raise WaitAbandoned("given up", waited_for="verifiers")
            time.sleep(0.05)
        total = [len(t) / 10 for t in texts]
        return NS(total=total, per_reward={"exact_match": total})


def _hung_step(rank: int, world: int):
    """Step 0 of a GRPO step on `world` ranks whose rank 0 hangs in its reward wait with a stop signal pending;
    returns (what `run` raised, whether the policy changed, seconds)."""
    from megatron_vlm.rl.grpo_step import GRPOStep
    from megatron_vlm.training.optim import OptimState
    from tests.unit.rl.test_grpo_step_algorithms import Encoder, Engine, TinyPolicy, _pool, _rl

    rl = _rl()
    torch.manual_seed(0)
    policy = TinyPolicy()
    before = [p.detach().clone() for p in policy.parameters()]
    opt = torch.optim.AdamW(policy.parameters(), lr=0.05)
    stop = StopFlag()
    stop.signum = 15  # SIGTERM
    ctx = NS(env=NS(device=torch.device("cpu"), rank=rank, world_size=world), stop=stop,
             cfg=NS(data=NS(max_tokens_per_pack=64), train=NS(seed=3, max_grad_norm=0.0)), to_device=lambda b: b)
    bundle = NS(dims=NS(dp_size=world, dp_rank=rank), wrapper=policy, trainable_params=list(policy.parameters()),
                moe_balancer=None)
    pool = _pool(8)
    grpo = GRPOStep(ctx, bundle, OptimState(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)), rl,
                    Engine(rl.batch.group_size, rl.rollout.max_new_tokens), Encoder(), HungManager(hang=rank == 0))
    t0 = time.monotonic()
    raised = ""
    try:
        grpo.run(0, pool[:4], prompt_pool=pool)
    except StepAbandoned as e:
        raised = str(e)
    took = time.monotonic() - t0
    changed = any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))
    return raised, changed, took


def _rank_worker(rank: int, init_file: str, out: str) -> None:
    # a rank that skipped a collective the other makes would fail after this timeout instead of hanging the test
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        torch.save(_hung_step(rank, 2), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_one_rank_abandons_a_hung_step_without_applying_it():
    raised, changed, took = _hung_step(0, 1)
    assert raised.startswith("this rank gave up waiting for its verifiers") and not changed and took < 10.0


def test_two_ranks_abandon_the_step_one_of_them_hung_in(tmp_path):
    """Rank 1 scored at once and went on to the agreement; rank 0 hung until the stop: both raise StepAbandoned
    together, within seconds (not the 30 s batch deadline), and neither applied the step."""
    out = str(tmp_path / "res")
    mp.spawn(_rank_worker, args=(str(tmp_path / "store"), out), nprocs=2, join=True)
    results = [torch.load(f"{out}.{r}") for r in range(2)]
    assert results[0][0] == "this rank gave up waiting for its verifiers: given up", results[0][0]
    assert results[1][0] == "another rank gave up waiting for its verifiers", results[1][0]
    assert not results[0][1] and not results[1][1]
    assert max(r[2] for r in results) < 15.0, results


class _Prompts:
    """A held-out prompt set."""

    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)


def _hung_eval(rank: int, world: int):
    """The held-out evaluation of a GRPO run on `world` ranks whose rank 0 hangs in its verifiers' wait with a stop
    signal pending; (what it raised, seconds)."""
    from megatron_vlm.eval.grpo_accuracy import evaluate_accuracy
    from tests.unit.rl.test_grpo_step_algorithms import Encoder, Engine, _pool, _rl

    rl = _rl()
    stop = StopFlag()
    stop.signum = 15
    ctx = NS(env=NS(device=torch.device("cpu"), rank=rank, world_size=world), stop=stop, cfg=NS(train=NS(seed=3)))
    wrapper = NS(eval=lambda: None, train=lambda: None)
    t0 = time.monotonic()
    try:
        out = evaluate_accuracy(ctx, wrapper, rl, Engine(1, rl.rollout.max_new_tokens), Encoder(),
                                HungManager(hang=rank == 0), _Prompts(_pool(4)), 5)
    except EvaluationAbandoned as e:
        out = str(e)
    return out, time.monotonic() - t0


def _eval_rank_worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        torch.save(_hung_eval(rank, 2), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_ranks_give_up_an_evaluation_one_of_them_hangs_in(tmp_path):
    """Rank 1 scored its held-out share and waits for rank 0 (hung until the stop) before the gather: both raise
    EvaluationAbandoned within seconds, not after the 30 s batch deadline with a row of zeros."""
    out = str(tmp_path / "res")
    mp.spawn(_eval_rank_worker, args=(str(tmp_path / "store"), out), nprocs=2, join=True)
    (why0, took0), (why1, took1) = (torch.load(f"{out}.{r}") for r in range(2))
    assert why0 == "this rank gave up waiting for its verifiers: given up", why0
    assert why1 == "another rank gave up waiting for its verifiers", why1
    assert max(took0, took1) < 15.0, (took0, took1)


def test_an_evaluation_without_a_stop_is_scored_as_before():
    from megatron_vlm.eval.grpo_accuracy import evaluate_accuracy
    from tests.unit.rl.test_grpo_step_algorithms import Encoder, Engine, _pool, _rl

    rl = _rl()
    ctx = NS(env=NS(device=torch.device("cpu"), rank=0, world_size=1), stop=StopFlag(), cfg=NS(train=NS(seed=3)))
    m = evaluate_accuracy(ctx, NS(eval=lambda: None, train=lambda: None), rl, Engine(1, rl.rollout.max_new_tokens),
                          Encoder(), HungManager(hang=False), _Prompts(_pool(4)), 5)
    assert m is not None and m["num_prompts"] == 4.0


# ---------------------------------------------------------------------------------------- the loop

class AbandonedAt:
    """Steps that draw from the global RNG; step `n` (0-based) draws, then is abandoned."""

    def __init__(self, n: int, bad_records=None):
        self.n, self.ran = n, []

    def load_data_state(self, state, step):
        pass

    def train_step(self, step, *, log):
        self.ran.append(step)
        torch.rand(3)
        if step == self.n:
            raise StepAbandoned("rank 0 gave up waiting for its verifiers")
        return {"loss": 1.0}

    def evaluate(self, step):
        return None

    def data_state(self, step):
        return {"next_step": step}

    def finish(self):
        self.finished = True


class Checkpointer:
    enabled, export_at_end = True, False

    def __init__(self, every=0):
        self.every, self.saved = every, []

    def periodic_due(self, step):
        return bool(self.every) and step % self.every == 0

    def save(self, step, data_state):
        self.saved.append((step, data_state, torch.get_rng_state()))


def _loop(steps, ckpt, total=10, logged=None, **kw):
    class NeverStop:
        def should_stop(self, device):
            return False

    logger = NS(set_start=lambda s: None, log=lambda *a: (logged if logged is not None else []).append(a[:2]))
    ctx = NS(stop=NeverStop(), device=torch.device("cpu"), run_dir=None)
    return run_loop(ctx, steps, total_steps=total, checkpointer=ckpt, metrics=logger, log_every=1, **kw)


class EvalAbandonedAt(AbandonedAt):
    """Steps that run; the evaluation after step `n` (steps done) is given up for a stop."""

    def evaluate(self, step):
        if step == self.n:
            raise EvaluationAbandoned("this rank gave up waiting for its verifiers: 4 verifier calls given up")
        return {"accuracy": 0.5}


@pytest.mark.parametrize("at, total, ran, saved", [(0, 4, [], []),  # before the first step: nothing to save
                                                   (2, 4, [0, 1], [2]),  # a periodic one: the step it followed
                                                   (4, 4, [0, 1, 2, 3], [4])])  # the final one: saved before it
def test_an_abandoned_evaluation_logs_nothing_of_it_and_stops_with_143(at, total, ran, saved):
    class Exporter(Checkpointer):
        export_at_end = True

        def export_hf(self, path):
            self.exported = True

    steps, ckpt, logged = EvalAbandonedAt(at), Exporter(), []
    assert _loop(steps, ckpt, total=total, logged=logged, eval_every=2, eval_at_start=True) == EXIT_STOPPED
    assert steps.ran == ran and steps.finished
    assert [s for s, _, _ in ckpt.saved] == saved
    assert ("eval", at) not in logged and [r for r in logged if r[0] == "eval"] == [("eval", s) for s in (0, 2)
                                                                                   if s < at]
    assert not getattr(ckpt, "exported", False)  # the final one given up: the requeued run evaluates and exports


def test_an_abandoned_step_saves_the_state_of_its_start_and_exits_143():
    torch.manual_seed(0)
    straight = AbandonedAt(-1)
    _loop(straight, Checkpointer(), total=2)
    at_step_2 = torch.get_rng_state()  # after the draws of steps 0 and 1
    torch.manual_seed(0)
    steps, ckpt = AbandonedAt(2), Checkpointer()
    assert _loop(steps, ckpt) == EXIT_STOPPED
    assert steps.ran == [0, 1, 2] and steps.finished
    (step, data, rng), = ckpt.saved
    assert (step, data) == (2, {"next_step": 2})  # the step before the abandoned one: its prompts are redone
    assert torch.equal(rng, at_step_2)  # the abandoned step's draws are not in the checkpoint


def test_an_abandoned_step_right_after_a_periodic_save_saves_nothing_more():
    steps, ckpt = AbandonedAt(2), Checkpointer(every=2)
    assert _loop(steps, ckpt) == EXIT_STOPPED
    assert [s for s, _, _ in ckpt.saved] == [2]


def test_the_synchronous_step_object_forgets_what_an_abandoned_step_found():
    """The prompts the encoder skipped in the abandoned step are skipped again when it is redone: kept, they would
    count twice in the checkpoint saved at its start. The step's prompts are drawn again."""
    from megatron_vlm.rl.trainer import GRPOLoopStep

    t = GRPOLoopStep.__new__(GRPOLoopStep)
    t.bad_records = BadRecordLog()
    t.bad_records.add("p.jsonl", 1, "corrupt_image", "truncated")
    t.rl, t.seed, t.train_set = NS(batch=NS(prompts_per_step=2)), 0, list(range(8))
    t._batches = None

    def run(step, batch, prompt_pool):
        t.bad_records.add("p.jsonl", 5, "corrupt_image", "truncated")
        t.bad_records.add("p.jsonl", 1, "corrupt_image", "truncated")
        raise StepAbandoned("gave up")

    t.grpo = NS(run=run)
    with pytest.raises(StepAbandoned):
        t.train_step(3, log=True)
    assert [(r["index"], r["skips"]) for r in t.bad_records.to_dict()["records"]] == [(1, 1)]
    assert t._batches is None


# ---------------------------------------------------------------------------------------- asynchronous GRPO

class _Bridge:
    """Training rank 0's end of the bridge: `answer(msgs)` gives a rollout rank's payload once the trainer's messages
    so far allow it (None: not yet)."""

    def __init__(self, answer):
        self.answer, self.sent = answer, []

    def broadcast_object(self, msg):
        self.sent.append(msg)

    def recv_object(self, src):  # noqa: ARG002
        while (p := self.answer(self.sent)) is None:
            time.sleep(0.02)
        return p


def _trainer(bridge, stop):
    t = AsyncGRPOLoopStep.__new__(AsyncGRPOLoopStep)
    t.bridge, t.ctx = bridge, NS(stop=stop)
    t.role = NS(allocation=NS(rollout=1, train=1))
    t.total_steps, t._prefetch, t.bad_records = 10, None, BadRecordLog()
    return t


def test_the_trainer_abandons_a_step_a_rollout_rank_gave_up_for_a_stop():
    skip = {"source": "p.jsonl", "index": 2, "category": "corrupt_image", "detail": "truncated", "skips": 1}
    bridge = _Bridge(lambda sent: {"step": 3, "stopped": True, "signum": 10, "bad_records": [skip]})
    t = _trainer(bridge, StopFlag())
    with pytest.raises(StepAbandoned, match="rollout rank 0 stopped before sending step 4's groups"):
        t._receive(3)
    assert t.ctx.stop.signum == 10  # the job stops (143) as for a signal of its own
    assert [m["step"] for m in bridge.sent] == [3]  # step 4 not asked for
    assert t._prefetch is None and len(t.bad_records) == 0
    unexplained = _trainer(_Bridge(lambda sent: {"step": 3, "stopped": True, "signum": 0}), StopFlag())
    with pytest.raises(RuntimeError, match="rollout rank 0 sent step 3's samples \\(stopped\\)"):
        unexplained._receive(3)


def test_a_trainer_stopped_alone_stops_the_rollout_ranks_it_waits_for():
    """The rollout ranks got no signal and hang in a reward batch; the trainer, stopped, tells them to stop once it has
    waited ABANDON_GRACE_S with its signal pending, and abandons the step on their answer."""
    def answer(sent):
        if any(m.get("kind") == "stop" for m in sent):
            return {"step": 3, "stopped": True, "signum": 0}  # the rollout rank's answer to "stop"
        return None

    stop = StopFlag()
    stop.signum = 15
    bridge = _Bridge(answer)
    t = _trainer(bridge, stop)
    t0 = time.monotonic()
    with pytest.raises(StepAbandoned):
        t._receive(3)
    assert time.monotonic() - t0 < ABANDON_GRACE_S + 4.0
    assert [m for m in bridge.sent if m.get("kind") == "stop"] == [{"kind": "stop", "signum": 15}]
    t.grpo, t._evaluate = NS(shards=NS(rank=0)), None
    t.ctx.env, t.ctx.run_dir = NS(is_main=True), None
    t.finish = lambda: AsyncGRPOLoopStep._stop_rollout(t)  # finish() does not send "stop" a second time
    t.finish()
    assert len([m for m in bridge.sent if m.get("kind") == "stop"]) == 1


def test_a_rollout_rank_answers_the_awaited_step_with_stopped_when_its_scoring_is_given_up():
    state = rr._State(0)
    state.signum = lambda: 10
    state.abandon = lambda: True
    state.wanted = 0
    sent = []
    bridge = NS(send_object=lambda obj, dst=0: sent.append(obj))

    class Manager:
        def metrics(self):
            return {}

        def score(self, texts, answers, prompts, metadata, abandon=None):
            assert abandon is not None and abandon()
            raise WaitAbandoned("given up", waited_for="verifiers")

    sample = NS(text="x", prompt_index=0)
    todo: queue.Queue = queue.Queue()
    todo.put({"step": 0, "indices": [0], "result": NS(samples=[sample], seconds=0.0), "idle_s": 0.0, "busy_s": 0.0,
              "skipped": 0})
    todo.put({"step": 1, "indices": [1], "result": NS(samples=[sample], seconds=0.0), "idle_s": 0.0, "busy_s": 0.0,
              "skipped": 0})
    worker = threading.Thread(target=rr._score_loop, args=(state, bridge, todo, Manager(), [NS(answer="", problem="",
                                                                                               metadata={})] * 2))
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive() and state.error is None, state.error
    assert sent == [{"step": 0, "stopped": True, "signum": 10}]


def test_every_training_rank_abandons_the_step_a_trainer_stopped_alone_gave_up(monkeypatch):
    """Training rank 0 alone got the signal (a `kill -USR1` of one rank: the flag is agreed at step boundaries) and
    stopped the rollout ranks, which answer "stopped" with no signal of their own. The other training ranks get rank
    0's payloads and must abandon the step too (and stop with its signal), not fail on a "stopped" payload while
    rank 0 saves."""
    import megatron_vlm.rl.asynchronous.trainer as trainer_mod

    shared = {}

    def gather_on_rank0(obj):
        shared["payloads"] = obj
        return [obj, None]

    monkeypatch.setattr(trainer_mod, "all_gather_objects", gather_on_rank0)
    stop = StopFlag()
    stop.signum = 10
    rank0 = _trainer(_Bridge(lambda sent: {"step": 3, "stopped": True, "signum": 0}
                             if any(m.get("kind") == "stop" for m in sent) else None), stop)
    rank0.role = NS(allocation=NS(rollout=1, train=2))
    with pytest.raises(StepAbandoned):
        rank0._receive(3)
    monkeypatch.setattr(trainer_mod, "all_gather_objects", lambda obj: [shared["payloads"], obj])
    rank1 = _trainer(None, StopFlag())  # no signal on this rank, no bridge (not the rank that talks to rollout)
    rank1.role = NS(allocation=NS(rollout=1, train=2))
    with pytest.raises(StepAbandoned):
        rank1._receive(3)
    assert rank1.ctx.stop.signum == 10  # it exits 143 with the others


class _LongEngine:
    """A rollout engine whose generation takes 200 decode steps of 10 ms unless its stop check gives it up."""

    takes_abandon = True

    def __init__(self):
        self.asked = 0

    def generate(self, prompts, params, generator=None, abandon=None):  # noqa: ARG002
        for _ in range(200):
            time.sleep(0.01)
            if abandon is not None:
                self.asked += 1
                if abandon():
                    raise WaitAbandoned("generation given up after some decode steps", waited_for="generation")
        return NS(samples=[], seconds=2.0)


class _HungEnvironments:
    """[rl.env]: conversations whose environment turn hangs until the stop check gives it up."""

    def generate(self, shard, params, seed, abandon=None):  # noqa: ARG002
        while not (abandon is not None and abandon()):
            time.sleep(0.01)
        raise WaitAbandoned("1 environment call given up: the rank is stopping", waited_for="environments")


@pytest.mark.parametrize("hung", ["generation", "environments"])
def test_a_rollout_rank_gives_up_its_generation_and_answers_the_step_when_asked_later(hung):
    """A rollout rank whose own stop flag is set (its node preempted) while it generates step 0. Its generation did not
    ask the flag: the whole rollout ran first. And a step given up in its generation (here, or a hung environment
    turn) was answered only if the trainer had already asked for it; a trainer asking later (it was training the
    step before) waited for ever. Now the engine's generation asks the flag between its steps, and the step is
    answered "stopped", with the signal, whenever the trainer asks for it."""
    rl = NS(asynchronous=NS(max_head_offpolicyness=1), batch=NS(group_size=2, prompts_per_step=2),
            rollout=NS(max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, stop=[]))
    ctx = NS(cfg=NS(rl=rl, train=NS(seed=3)), env=NS(device="cpu"))
    role = NS(rank=0, allocation=NS(rollout=1))
    state = rr._State(0)
    state.signum = lambda: 15
    state.abandon = lambda: True  # a stop pending since before the step (no grace left)
    engine = _LongEngine()
    sent: list = []
    bridge = NS(send_object=lambda obj, dst=0: sent.append(obj))
    todo: queue.Queue = queue.Queue()
    scoring = threading.Thread(target=rr._score_loop, args=(state, bridge, todo, NS(metrics=dict), []), daemon=True)
    scoring.start()
    t0 = time.monotonic()
    rr._generate_loop(ctx, role, state, engine, NS(encode=lambda s: s, skipped=0), [0, 1, 2, 3], todo, 0, 1,
                      _HungEnvironments() if hung == "environments" else None)
    todo.put(None)
    assert time.monotonic() - t0 < 1.5  # not the 2 s of the whole generation
    assert engine.asked >= 1 or hung == "environments"
    time.sleep(0.2)
    assert sent == []  # the trainer has not asked for step 0 yet: nothing is sent without a receiver
    with state.cond:  # the trainer's "want" for step 0 (the weight thread's part)
        state.wanted = 0
        state.cond.notify_all()
    scoring.join(timeout=5)
    assert not scoring.is_alive() and state.error is None, state.error
    assert sent == [{"step": 0, "stopped": True, "signum": 15}]
