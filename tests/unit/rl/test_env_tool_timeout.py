"""A tool call that hangs past `[rl.env] tool_timeout_s` is stopped and answered with an error reply ("timed out"),
counted in env/tool_timeouts, and the conversation goes on, as verl's and AReaL's tool loops do; the worker stays
usable for the next call. It used to end the whole trajectory at turn_timeout_s (the worker killed) without the
model hearing why. The whole-turn deadline stays the last resort, for a tool that will not be stopped."""
import json
import pickle
import time

import pytest

from megatron_vlm.rl.env.base import EnvSample
from megatron_vlm.rl.env.config import RLEnvConfig
from megatron_vlm.rl.env.pool import EnvCall, EnvWorkerPool, InlineEnvRunner, build_environment

FNS = "rl_env_fns_for_tests"


def _call(name: str, seconds: float) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": {"seconds": seconds}})}</tool_call>'


def _state() -> bytes:
    env = build_environment(f"{FNS}:SlowTools")
    env.reset(EnvSample(problem="q"))
    return pickle.dumps(env)


def test_a_hanging_tool_is_answered_and_the_conversation_goes_on():
    with EnvWorkerPool(num_workers=1, timeout_s=20.0) as pool:
        t0 = time.monotonic()
        (r,) = pool.run([EnvCall("step", state=_state(), action=_call("_slow_tool", 3600) + _call("_slow_tool", 0),
                                 tool_timeout_s=0.5)])
        assert time.monotonic() - t0 < 10, "the tool's call was not stopped at its deadline"
        assert not r.error and not r.result.done, r.error
        texts = [p["text"] for p in r.result.observation.parts]
        assert "timed out after 0.5 s" in texts[0] and texts[1] == "slept", texts
        assert r.result.info["tool_timeouts"] == 1 and r.result.info["tool_errors"] == 1
        (again,) = pool.run([EnvCall("step", state=r.state, action=_call("_slow_tool", 0), tool_timeout_s=0.5)])
        assert not again.error and pool.restarts == 0  # the same worker answers the next turn
        (done,) = pool.run([EnvCall("step", state=again.state, action="42", tool_timeout_s=0.5)])
        assert done.result.done and done.result.reward == 1.0
        # a tool that catches the stop and sleeps on (a bare except) is answered as timed out all the same
        (late,) = pool.run([EnvCall("step", state=_state(), action=_call("_stubborn_tool", 1.0), tool_timeout_s=0.2)])
        assert not late.error and "timed out" in late.result.observation.parts[0]["text"], late
        assert late.result.info["tool_timeouts"] == 1


def test_without_a_tool_deadline_nothing_is_stopped():
    (r,) = InlineEnvRunner().run([EnvCall("step", state=_state(), action=_call("_slow_tool", 0.3))])
    assert r.result.observation.parts[0]["text"] == "slept" and r.result.info["tool_timeouts"] == 0


@pytest.mark.parametrize("keys, why", [
    ({"tool_timeout_s": -1.0}, "tool_timeout_s"),
    ({"tool_timeout_s": 30.0}, "tool_timeout_s"),  # not below turn_timeout_s: the turn's deadline would come first
])
def test_the_key_is_checked(keys, why):
    with pytest.raises(ValueError, match=why):
        RLEnvConfig(name="x:Y", **keys).validate()


def test_the_default_deadline_is_half_the_turns():
    assert RLEnvConfig(name="x:Y", turn_timeout_s=8.0).tool_deadline_s() == 4.0
    assert RLEnvConfig(name="x:Y", tool_timeout_s=0.0).tool_deadline_s() == 0.0  # off


def test_the_session_sends_the_deadline_with_each_step():
    from megatron_vlm.rl.env.pool import EnvReply

    sent = []

    class Runner:
        def run(self, calls):
            sent.extend(calls)
            return [EnvReply(state=b"s") for _ in calls]

    from megatron_vlm.rl.env.session import EnvSession

    session = EnvSession(Runner(), encoder=None, name="x:Y", kwargs={}, samples=[EnvSample(problem="q")],
                         histories=[[]], n=1, eos_token_ids=[0], tool_timeout_s=1.5, turn_timeout_s=4.0)
    session.step([(0, 0, "hi", [0], 10)])
    assert [(c.tool_timeout_s, c.turn_timeout_s) for c in sent if c.op == "step"] == [(1.5, 4.0)]


def test_the_calls_of_one_turn_share_its_time():
    """Two hanging calls of 2 s each in a turn of 3 s: the second is stopped when the turn's time runs short (a share
    of it kept for the reply), so both are answered; it used to run its full 2 s and the turn's deadline killed the
    worker (env_error)."""
    with EnvWorkerPool(num_workers=1, timeout_s=3.0) as pool:
        (r,) = pool.run([EnvCall("step", state=_state(), action=_call("_slow_tool", 3600) * 2, tool_timeout_s=2.0,
                                 turn_timeout_s=3.0)])
        assert not r.error and pool.restarts == 0, r.error
        assert [p["text"].startswith("Error: _slow_tool timed out") for p in r.result.observation.parts] == [True] * 2
        assert r.result.info["tool_timeouts"] == 2


def test_a_sigalrm_handler_python_cannot_restore_means_no_tool_deadline(monkeypatch):
    """A SIGALRM handler installed from C reads as None: putting it back after the call would raise TypeError and fail
    every tool call, so such a process runs its tools without a per-call deadline (the turn's timeout still holds)."""
    import signal

    from megatron_vlm.rl.env import tools

    real_signal, before = signal.signal, signal.getsignal(signal.SIGALRM)

    def c_installed(signum, handler):  # what signal.signal does when the current handler came from C
        if handler is None:
            raise TypeError("signal handler must be signal.SIG_IGN, signal.SIG_DFL, or a callable object")
        real_signal(signum, handler)
        return None

    monkeypatch.setattr(signal, "getsignal", lambda signum: None)
    monkeypatch.setattr(signal, "signal", c_installed)
    monkeypatch.setattr(signal, "getitimer", lambda which: (0.0, 0.0))  # no other timer (pytest-timeout may run one)
    monkeypatch.setattr(signal, "setitimer", lambda which, seconds, interval=0.0: (0.0, 0.0))  # leave it running
    try:
        out, timed_out = tools._run_with_deadline(lambda x: x + 1, {"x": 1}, seconds=5.0)
    finally:
        real_signal(signal.SIGALRM, before)
    assert (out, timed_out) == (2, False)
