"""The environment workers' memory cap ([rl.reward_pool] memory_limit_mb, RLIMIT_AS in each worker): an environment
or tool that allocates past it is stopped (a MemoryError in the worker, or the worker dies and is replaced) and its
trajectory ends as env_error, counted, while the pool and the other trajectories go on."""
import pytest
from multiturn_helpers import rollout, vqa_file

from megatron_vlm.rl.env.pool import EnvCall, EnvWorkerPool
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset

FNS = "rl_env_fns_for_tests"
ENV = f"{FNS}:AllocateOn"


@pytest.fixture(scope="module")
def pool():
    with EnvWorkerPool(num_workers=1, timeout_s=30.0, memory_limit_mb=1024, preload=(ENV,)) as p:
        assert not p.start()
        yield p


def test_an_allocation_past_the_cap_is_an_error_reply(pool):
    (reset,) = pool.run([EnvCall("reset", name=ENV, kwargs={"word": "", "mib": 2048})])
    assert not reset.error
    (reply,) = pool.run([EnvCall("step", state=reset.state, action="x")])
    assert reply.result is None and "MemoryError" in reply.error, reply.error
    # the same pool goes on, and an allocation under the cap works
    (small,) = pool.run([EnvCall("reset", name=ENV, kwargs={"word": "", "mib": 64})])
    (ok,) = pool.run([EnvCall("step", state=small.state, action="x")])
    assert not ok.error and ok.result.observation.text == str(64 * 2**20)


def test_the_capped_environment_ends_only_its_trajectories(pool, tmp_path):
    vqa = vqa_file(tmp_path / "vqa")
    problems = [s.problem for s in load_prompt_dataset(vqa, schema="messages").samples]
    word = next(w for w in problems[0].split() if w not in problems[1])
    _, _, trajs, session = rollout("tiny_qwen2_5_vl", vqa, tmp_path, env=ENV, kwargs={"word": word, "mib": 2048},
                                   runner=pool, max_turns=2, n=1)
    assert [t.finish_reason for t in trajs] == ["env_error", "max_turns"] and session.errors == 1
    assert "MemoryError" in trajs[0].error and trajs[1].turn_rewards == [0.25, 0.25]


def test_a_cap_the_platform_does_not_enforce_is_refused_naming_the_key():
    """Where RLIMIT_AS is accepted but not enforced, the key would silently do nothing: the pool's start refuses it
    (ConfigError: exit 2 naming rl.reward_pool.memory_limit_mb); without a cap the same workers start."""
    import rl_env_fns_for_tests as fns

    from megatron_vlm.errors import ConfigError

    class Unenforced(EnvWorkerPool):
        worker_main = staticmethod(fns.worker_without_address_cap)

    with Unenforced(num_workers=1, memory_limit_mb=1024) as p, \
            pytest.raises(ConfigError, match=r"^rl\.reward_pool\.memory_limit_mb: 1024 .*not enforced"):
        p.start()
    with Unenforced(num_workers=1, memory_limit_mb=0) as p:
        assert p.start() == {}
