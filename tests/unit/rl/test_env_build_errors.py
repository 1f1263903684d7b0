"""An environment the trainer cannot build (constructor arguments `[rl.env] kwargs` does not fit, a missing class,
`tools()` that raises) stops the job at start with a configuration error naming the key to fix (exit 2 through the
launcher), before any worker or rollout: it used to escape as the constructor's TypeError traceback (and a missing
class without the sandbox as a bare ValueError)."""
from types import SimpleNamespace

import pytest

from megatron_vlm.errors import ConfigError
from megatron_vlm.rl.env.config import RLEnvConfig
from megatron_vlm.rl.env.rollout import MultiTurnRounds

FNS = "rl_env_fns_for_tests"


@pytest.mark.parametrize("name, kwargs, key, why", [
    (f"{FNS}:NeedsAnArgument", {}, "rl.env.kwargs", "level"),
    ("calculator", {"precision": 3}, "rl.env.kwargs", "precision"),
    (f"{FNS}:NoSuchClass", {}, "rl.env.name", "NoSuchClass"),
    (f"{FNS}:ToolsRaise", {}, "rl.env.name", "no tool box"),
])
def test_an_environment_that_cannot_be_built_names_the_key(name, kwargs, key, why):
    rl = SimpleNamespace(env=RLEnvConfig(name=name, kwargs=kwargs, sandbox=False),
                         reward_pool=SimpleNamespace(workers=1, memory_limit_mb=0), rewards=["a verifier"])
    with pytest.raises(ConfigError) as e:
        MultiTurnRounds.from_config(rl, 4096, engine=None, processor=None)
    assert str(e.value).startswith(key) and why in str(e.value), str(e.value)


def test_check_builds_the_environment(monkeypatch, capsys):
    """`--check` builds the environment as the run will (its tools for the prompts), so a misspelt class or kwargs
    the constructor does not take fail there (exit 2 naming the key), not at the job's start after the model
    loaded; a good one is reported with its tools."""
    from pathlib import Path

    from megatron_vlm.config import load_config
    from megatron_vlm.plan import check

    demo = Path(__file__).resolve().parents[3] / "launch" / "configs" / "demo_grpo.toml"
    monkeypatch.setattr(check, "plan_run", lambda cfg, **kw: [])  # the model's plan is not what this test is about
    for env, code, say in (('{name = "calculator", kwargs = {precision = 3}}', 2, "check failed: rl.env.kwargs"),
                           ('{name = "calculator"}', 0, "1 tool(s): calculate")):
        cfg = load_config(demo, [f"rl.env={env}", 'rl.rollout.weights="copy"'])
        assert check.run_check(cfg, world_size=1, device_memory_gib=80.0) == code
        out = capsys.readouterr()
        assert say in out.out + out.err, out
