"""Multi-turn limits and failures: max_turns and max_total_tokens end a trajectory with that finish reason; an
environment that raises, hangs or crashes (in the sandboxed worker pool) ends only its own trajectory with
"env_error", counted, and the rollout goes on; only the model's tokens carry loss; the batching of
conversations at different turns does not change any conversation's tokens."""
import pytest
import torch
from multiturn_helpers import rollout, vqa_file

from megatron_vlm.rl.env.pool import EnvCall, EnvWorkerPool
from megatron_vlm.rl.env.trajectories import trajectory_train_sample

FNS = "rl_env_fns_for_tests"


@pytest.fixture(scope="module")
def vqa(tmp_path_factory):
    return vqa_file(tmp_path_factory.mktemp("vqa"))


def test_max_turns_marks_the_finish_reason(vqa, tmp_path):
    _, prompts, trajs, session = rollout("tiny_qwen2_5_vl", vqa, tmp_path, env=f"{FNS}:Echo", max_turns=2)
    assert session.errors == 0
    tok = session.encoder.proc.tokenizer  # the session's end-of-turn id (test_env_turn_end.py): <|im_end|>'s
    assert session.encoder.turn_end_id == tok.convert_tokens_to_ids("<|im_end|>") != tok.convert_tokens_to_ids("<|endoftext|>")
    assert [t.finish_reason for t in trajs] == ["max_turns"] * 4
    for t in trajs:
        assert t.num_turns == 2 and t.turn_rewards == [0.25, 0.25]
        # model turn, environment turn, model turn: the mask has exactly two runs of model tokens
        runs = int((t.model_mask[1:] & ~t.model_mask[:-1]).sum()) + int(t.model_mask[0])
        assert runs == 2 and bool(t.model_mask[-1])
        assert t.logprobs.numel() == int(t.model_mask.sum())
    # continuous batching: the decode steps served several conversations (fewer steps than tokens fed)
    fed = sum(int(t.model_mask.sum()) - t.num_turns for t in trajs)
    assert session.engine_stats["decode_steps"] < fed


def test_max_total_tokens_marks_the_finish_reason(vqa, tmp_path):
    limit = 120  # the prompts are ~70 tokens: room for a few turns
    _, prompts, trajs, _ = rollout("tiny_qwen2_5_vl", vqa, tmp_path, env=f"{FNS}:Echo", max_turns=50, max_total=limit)
    assert [t.finish_reason for t in trajs] == ["max_total_tokens"] * 4
    for t in trajs:
        assert t.prompt_length + t.token_ids.numel() <= limit
        assert t.num_turns >= 2
        assert t.truncated


def test_only_model_tokens_carry_loss(vqa, tmp_path):
    _, prompts, trajs, _ = rollout("tiny_qwen2_5_vl", vqa, tmp_path, env=f"{FNS}:Echo", max_turns=3)
    from megatron_vlm.data.batch import IGNORE_INDEX
    from megatron_vlm.rl.batching import pack_samples

    t = trajs[0]
    s = trajectory_train_sample(prompts[t.prompt_index], t, advantage=1.0)
    batch = pack_samples([s])
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    full = torch.cat([prompts[t.prompt_index].input_ids, t.token_ids])
    trained = torch.cat([torch.zeros(len(prompts[t.prompt_index]), dtype=torch.bool), t.model_mask])
    # labels[i] = the token at i + 1 exactly where that token is the model's
    expect = torch.where(trained[1:], full[1:], torch.full_like(full[1:], IGNORE_INDEX))
    assert torch.equal(labels, expect[: labels.numel()]) and torch.equal(ids, full[: ids.numel()])
    assert s.response_length == int(t.model_mask.sum()) < t.token_ids.numel()


def test_conversations_are_independent_of_their_batch(vqa, tmp_path):
    """A conversation draws from its own generator: the same tokens whether 3 or 1 conversations share a step."""
    _, _, a, _ = rollout("tiny_qwen2_5_vl", vqa, tmp_path / "a", env=f"{FNS}:Echo", max_turns=3)
    _, _, b, _ = rollout("tiny_qwen2_5_vl", vqa, tmp_path / "b", env=f"{FNS}:Echo", max_turns=3, n=1)
    assert a[0].token_ids.tolist() == b[0].token_ids.tolist()
    assert a[2].token_ids.tolist() != a[0].token_ids.tolist()


@pytest.mark.parametrize("env", ["ImageSecondTurn", "VideoSecondTurn", "Echo"])
def test_cache_continued_equals_history_prefilled_again(env, vqa, tmp_path):
    """Prefilling only the new tokens into the kept cache gives the tokens and log-probs of prefilling the whole
    history again after every environment turn (the engine without a cache across turns), with far fewer
    prefilled tokens."""
    _, _, a, sa = rollout("tiny_qwen2_5_vl", vqa, tmp_path / "a", env=f"{FNS}:{env}", max_turns=3, n=1)
    _, _, b, sb = rollout("tiny_qwen2_5_vl", vqa, tmp_path / "b", env=f"{FNS}:{env}", max_turns=3, n=1, reprefill=True)
    for x, y in zip(a, b):
        assert x.token_ids.tolist() == y.token_ids.tolist() and x.finish_reason == y.finish_reason
        torch.testing.assert_close(x.logprobs, y.logprobs, atol=1e-5, rtol=0)
    assert sa.engine_stats["append_tokens"] < sb.engine_stats["append_tokens"]


def test_raising_environment_ends_its_trajectory_counted(vqa, tmp_path):
    _, _, trajs, session = rollout("tiny_qwen2_5_vl", vqa, tmp_path, env=f"{FNS}:Raise")
    assert [t.finish_reason for t in trajs] == ["env_error"] * 4 and session.errors == 4
    assert all("RuntimeError: environment bug" in t.error and t.num_turns == 1 for t in trajs)


# imported when each worker starts, not inside a call's 3 s deadline (the first import of the test module in a
# worker can take seconds on a loaded machine)
PRELOAD = tuple(f"{FNS}:{name}" for name in ("Echo", "Hang", "Crash", "Raise", "HangOnReset"))


@pytest.fixture(scope="module")
def pool():
    with EnvWorkerPool(num_workers=2, timeout_s=3.0, preload=PRELOAD) as p:
        p.start()
        yield p


@pytest.mark.parametrize("env, why", [("Hang", "timeout"), ("Crash", "died"), ("Raise", "environment bug"),
                                      ("HangOnReset", "timeout")])
def test_sandboxed_failures_end_their_trajectory(env, why, pool):
    reset = pool.run([EnvCall("reset", name=f"{FNS}:{env}")])[0]
    if env == "HangOnReset":
        assert reset.error.startswith("timeout") and why in reset.error
        return
    assert not reset.error
    (reply,) = pool.run([EnvCall("step", state=reset.state, action="hi")])
    assert why in reply.error and reply.result is None
    # the pool keeps working: a healthy environment's turn right after
    ok = pool.run([EnvCall("reset", name=f"{FNS}:Echo")])[0]
    (step,) = pool.run([EnvCall("step", state=ok.state, action="x")])
    assert not step.error and step.result.observation.text == "go on" and step.result.reward == 0.25


def test_a_hanging_environment_in_the_rollout(vqa, tmp_path):
    # a pool of its own, started with the environment imported: the reset must not spend the 3 s deadline on the
    # first import of the test module in a worker ("reset: timeout" on a loaded machine, a flake)
    with EnvWorkerPool(num_workers=2, timeout_s=3.0, preload=PRELOAD) as fresh:
        fresh.start()
        _, _, trajs, session = rollout("tiny_qwen2_5_vl", vqa, tmp_path, env=f"{FNS}:Hang", runner=fresh, n=1)
    assert [t.finish_reason for t in trajs] == ["env_error"] * 2 and session.errors == 2
    assert all(t.error.startswith("step: timeout") for t in trajs), [t.error for t in trajs]


def test_a_non_finite_behaviour_logprob_is_refused(vqa, tmp_path, monkeypatch):
    """Off the CPU the sampler leaves rows without a distribution (a NaN logit) to the engine: their token comes with
    a non-finite log-prob, which the multi-turn loop refuses naming the trajectory instead of training on it."""
    import megatron_vlm.inference.multiturn as mt

    real = mt.sample_tokens

    def accelerator_like(logits, **kw):
        tok, lp = real(logits, **kw)
        return tok, lp.clone().fill_(float("nan"))

    monkeypatch.setattr(mt, "sample_tokens", accelerator_like)
    with pytest.raises(ValueError, match="rollout: trajectory 0, generated token 0: .*NaN"):
        rollout("tiny_qwen2_5_vl", vqa, tmp_path, env=f"{FNS}:Echo", max_turns=2)


def test_a_turn_batch_deadline_bounds_a_turn_of_many_hanging_environments():
    """rl.env.batch_timeout_s: four hanging environments on one worker would take 4 x turn_timeout_s (12 s) in turn;
    under a 1.5 s batch deadline the turn ends at the deadline, every call an error reply (env_error): the one that
    ran is cut at the deadline and the three queued behind it are never started (their replies say so; timing is
    not asserted, the test machine's load would decide it)."""
    with EnvWorkerPool(num_workers=1, timeout_s=3.0, preload=PRELOAD, batch_timeout_s=1.5) as p:
        p.start()
        states = [p.run([EnvCall("reset", name=f"{FNS}:Hang")])[0].state for _ in range(4)]
        replies = p.run([EnvCall("step", state=s, action="hi") for s in states])
    errors = [r.error for r in replies]
    assert all(r.error and r.result is None for r in replies), errors
    assert sum("batch deadline" in e and e.endswith("(not started)") for e in errors) == 3, errors


def test_batch_timeout_needs_the_sandbox():
    from megatron_vlm.rl.env.config import RLEnvConfig

    RLEnvConfig(name="x:Y", batch_timeout_s=5.0).validate()
    for bad, why in ((dict(batch_timeout_s=-1.0), "finite and >= 0"), (dict(batch_timeout_s=5.0, sandbox=False), "sandbox")):
        with pytest.raises(ValueError, match=why):
            RLEnvConfig(name="x:Y", **bad).validate()


def test_batch_timeout_reaches_the_worker_pool(monkeypatch):
    """The key is read by the multi-turn rounds' worker pool (both loops build it with MultiTurnRounds.from_config)."""
    from types import SimpleNamespace

    from megatron_vlm.rl.env import rollout as env_rollout
    from megatron_vlm.rl.env.config import RLEnvConfig

    built = {}

    class Pool:
        def __init__(self, **kw):
            built.update(kw)

        def start(self):
            return {}

    monkeypatch.setattr(env_rollout, "EnvWorkerPool", Pool)
    monkeypatch.setattr(env_rollout.MultiTurnRounds, "__init__", lambda self, *a, **k: None)
    rl = SimpleNamespace(env=RLEnvConfig(name=f"{FNS}:Echo", batch_timeout_s=7.5),
                         reward_pool=SimpleNamespace(workers=2, memory_limit_mb=0), rewards=["a verifier"])
    env_rollout.MultiTurnRounds.from_config(rl, 4096, engine=None, processor=None)
    assert built["batch_timeout_s"] == 7.5 and built["timeout_s"] == 30.0
