"""`--check` imports the run's custom reward functions the way the run does, and names the key when one fails.

Found as a gap: a `[[rl.rewards]]` table with `type = "custom"` and a misspelt module or function passed `--check`
("check ok") and failed only when the job had its nodes, had loaded the model and built its rewards. The check now
starts one reward worker, imports every custom function there (never in the launcher's own process: a user module
may exit or crash at import) and checks its signature against the call the run makes.
"""
from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from megatron_vlm.config import load_config
from megatron_vlm.errors import ConfigError
from megatron_vlm.plan.check import run_check
from megatron_vlm.rl.rewards.combined import CombinedRewards
from megatron_vlm.rl.rewards.config import CustomRewardConfig, ModelRewardConfig

CONFIGS = Path(__file__).resolve().parents[3] / "launch" / "configs"
MODULE = "check_custom_reward_fns"


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / f"{MODULE}.py").write_text(
        "def length(completion, answer, **kwargs):\n    return float(len(completion))\n\n"
        "def two_args(completion, answer):\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned reward worker inherits the launcher's sys.path
    yield tmp_path
    sys.modules.pop(MODULE, None)


def _check(tmp_path, function: str) -> tuple[int, str, str]:
    overrides = [f'model.path="{tmp_path / "policy"}"', 'model.synthesize="tiny_qwen2_5_vl"',
                 f'rl.rewards=[{{type = "exact_match"}}, {{type = "custom", function = "{function}"}}]']
    out, err = io.StringIO(), io.StringIO()
    code = run_check(load_config(CONFIGS / "demo_grpo.toml", overrides), world_size=1, device_memory_gib=80.0,
                     out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_a_custom_reward_that_would_not_start_fails_the_check_naming_its_key(user_module):
    """One case per check (each starts a worker); the kinds of failure are the run's own (test_reward_function_check)."""
    code, _, err = _check(user_module, f"{MODULE}.lenght")
    assert code == 2
    assert err.startswith("check failed: rl.rewards[1].function: ") and "'lenght' is not a callable" in err


def test_an_importable_custom_reward_passes_and_is_listed(user_module):
    code, out, err = _check(user_module, f"{MODULE}.length")
    assert (code, err) == (0, "")
    assert "rewards    1 custom verifier(s) import in a reward worker" in out


def test_rule_rewards_beside_a_reward_model_name_their_own_index(tmp_path):
    """The rule rewards run in their own manager beside the reward models: its errors name the configured index."""
    rewards = [ModelRewardConfig(path=str(tmp_path / "rm")), CustomRewardConfig(function="no_such_pkg_xyz.f")]
    with pytest.raises(ConfigError, match=r"^rl\.rewards\[1\]\.function: "):
        CombinedRewards(rewards, pool=dict(timeout_s=30.0, num_workers=1))


def test_the_entry_point_searches_the_folder_the_job_starts_in_last(tmp_path, monkeypatch):
    """The quick form of the test below: what launch/pretrain_vlm.py adds to sys.path when it is loaded."""
    import importlib.util

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    spec = importlib.util.spec_from_file_location("entry_under_test", CONFIGS.parents[1] / "launch" / "pretrain_vlm.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert sys.path[-1] == str(tmp_path) and sys.path.count(str(tmp_path)) == 1


@pytest.mark.heavy  # ~10-15 s: a whole --check through the command line, with a reward worker
def test_a_reward_module_in_the_folder_the_job_starts_in_is_importable(tmp_path):
    """Relative paths in a config are the folder the job starts in, but `python launch/pretrain_vlm.py` puts launch/ on
    sys.path, not that folder: `function = "my_rewards.score"` next to the user's config failed ("No module named
    'my_rewards'") unless they knew to set PYTHONPATH. The folder is searched last (it cannot shadow a package)."""
    import os
    import subprocess

    (tmp_path / "cwd_reward_fns.py").write_text("def score(completion, answer, **kwargs):\n    return 1.0\n")
    repo = CONFIGS.parents[1]
    r = subprocess.run([sys.executable, str(repo / "launch" / "pretrain_vlm.py"), "--config",
                        str(CONFIGS / "demo_grpo.toml"), "--check", "--device-memory-gib", "80",
                        "--set", f'model.path="{tmp_path / "policy"}"', "--set", 'model.synthesize="tiny_qwen2_5_vl"',
                        "--set", 'rl.rewards=[{type = "custom", function = "cwd_reward_fns.score"}]'],
                       capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "1 custom verifier(s) import in a reward worker" in r.stdout
