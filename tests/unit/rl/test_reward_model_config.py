"""`[[rl.rewards]]` of type "model" / "judge" through the strict loader: every key is read, a wrong one is a
config error naming it (exit 2), and a folder that cannot be loaded names `rl.rewards[i].path` at start."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_vlm.config import load_config
from megatron_vlm.errors import ConfigError
from megatron_vlm.rl.rewards.combined import CombinedRewards
from megatron_vlm.rl.rewards.config import JudgeRewardConfig, ModelRewardConfig, reward_from_dict

DEMO = Path(__file__).resolve().parents[3] / "launch" / "configs" / "demo_grpo_reward_model.toml"


def _config(tmp_path, rewards: str, extra: str = ""):
    text = DEMO.read_text().replace('accuracy_reward = "exact_match"\n', "")
    start = text.index("\n[[rl.rewards]]") + 1
    end = text.index("\n[rl.eval]") + 1
    path = tmp_path / "c.toml"
    path.write_text(text[:start] + rewards + "\n" + text[end:] + extra)
    return load_config(path)


def test_the_demo_config_reads_every_key():
    cfg = load_config(DEMO)
    rm, rule = cfg.rl.rewards
    assert isinstance(rm, ModelRewardConfig) and rm.activation == "sigmoid" and rm.batch_size == 64
    assert rule.weight == 0.0 and cfg.rl.accuracy_label() == "exact_match"


def test_all_keys_of_both_kinds_load(tmp_path):
    cfg = _config(tmp_path, '''
[[rl.rewards]]
type = "model"
path = "rm"
batch_size = 3
max_tokens = 99
activation = "softmax"
logit_index = 1
failure_value = -3.0
offload = true
weight = 0.5

[[rl.rewards]]
type = "judge"
name = "j"
path = "judge"
template = "Q {question} A {completion} R {reference}"
parse = "score"
max_score = 5.0
max_new_tokens = 3
max_tokens = 300
images = false
batch_size = 2
offload = true
''')
    rm, judge = cfg.rl.rewards
    assert (rm.batch_size, rm.max_tokens, rm.activation, rm.logit_index, rm.offload, rm.weight) == (3, 99, "softmax", 1, True, 0.5)
    assert rm.failure_value == -3.0
    assert (judge.parse, judge.scale(), judge.max_new_tokens, judge.max_tokens, judge.images, judge.batch_size) == (
        "score", 5.0, 3, 300, False, 2)


@pytest.mark.parametrize("table, key", [
    ('type = "model"\npath = "rm"\nbatchsize = 4', "batchsize"),
    ('type = "model"', "path"),
    ('type = "model"\npath = "rm"\nactivation = "tanh"', "activation"),
    ('type = "model"\npath = "rm"\nbatch_size = 0', "batch_size"),
    ('type = "model"\npath = "rm"\nlogit_index = -1', "logit_index"),
    ('type = "model"\npath = "rm"\nfailure_value = nan', "failure_value"),
    ('type = "model"\npath = "rm"\nfailure_value = "lowest"', "failure_value"),
    ('type = "judge"\npath = "j"\ntemplate = "{question} {answer}"', "template"),
    ('type = "judge"\npath = "j"\ntemplate = "{question}"', "template"),
    ('type = "judge"\npath = "j"\ntemplate = "{completion"', "template"),
    ('type = "judge"\npath = "j"\ntemplate = "{completion!r}"', "template"),
    ('type = "judge"\npath = "j"\nmax_score = 5.0', "max_score"),
    ('type = "judge"\npath = "j"\nparse = "score"\nmax_score = 0.0', "max_score"),
    ('type = "judge"\npath = "j"\nmax_new_tokens = 8\nmax_tokens = 8', "max_tokens"),
    ('type = "judge"\npath = "j"\nparse = "likert"', "parse"),
])
def test_a_wrong_key_names_itself(tmp_path, table, key):
    with pytest.raises(ConfigError, match=rf"rl\.rewards\[0\]\.{key}"):
        _config(tmp_path, f"[[rl.rewards]]\n{table}\n")


def test_asynchronous_grpo_refuses_model_rewards():
    with pytest.raises(ConfigError, match=r"rl\.rewards\[0\]\.type: 'model'.*allocation"):
        load_config(DEMO, ['rl.allocation="rollout:1+train:1"'])


def test_reward_from_dict_builds_the_new_kinds():
    assert reward_from_dict({"type": "model", "path": "x"}).path == "x"
    assert isinstance(reward_from_dict({"type": "judge", "path": "x"}), JudgeRewardConfig)
    with pytest.raises(ValueError, match=r"rl.rewards\[0\]\.label: unknown key"):
        reward_from_dict({"type": "model", "path": "x", "label": 1})


def test_a_folder_that_cannot_be_loaded_names_the_path_key(tmp_path):
    with pytest.raises(ConfigError, match=r"rl\.rewards\[1\]\.path: cannot load the model folder"):
        CombinedRewards([JudgeRewardConfig(path="unused"), ModelRewardConfig(path=str(tmp_path / "missing"))],
                        scorers={0: object()})


def test_max_tokens_past_the_models_positions_is_refused_at_start(tmp_path, tiny_vlm_folder):
    """A `max_tokens` above the scoring model's `max_position_embeddings` (config.json; a VLM's text model's) scored
    tokens at positions the model was never trained for: silent garbage. The run refuses it at start naming the key
    (as vLLM refuses a `max_model_len` above it); the judge's `max_tokens` (its prompt + answer) too."""
    import json

    from tests.unit.rl.test_reward_model import _hf_seqcls_folder

    _hf_seqcls_folder(tmp_path / "rm", "qwen2", 1)
    limit = json.loads((tmp_path / "rm" / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(ConfigError, match=rf"rl\.rewards\[1\]\.max_tokens: {limit + 1} is above .*"
                                          rf"max_position_embeddings = {limit}"):
        CombinedRewards([JudgeRewardConfig(path="unused"), ModelRewardConfig(path=str(tmp_path / "rm"),
                                                                              max_tokens=limit + 1)], scorers={0: object()})
    CombinedRewards([ModelRewardConfig(path=str(tmp_path / "rm"), max_tokens=limit)]).close()  # at the limit: fine
    hf = json.loads((Path(tiny_vlm_folder) / "config.json").read_text())
    vlm_limit = (hf.get("text_config") or hf)["max_position_embeddings"]
    with pytest.raises(ConfigError, match=rf"rl\.rewards\[0\]\.max_tokens: {vlm_limit + 8} is above"):
        CombinedRewards([JudgeRewardConfig(path=str(tiny_vlm_folder), max_tokens=vlm_limit + 8)])


@pytest.mark.parametrize("hf, refused", [
    ({"max_position_embeddings": 4096}, "max_position_embeddings = 4096"),
    ({"max_position_embeddings": 128000, "text_config": {"max_position_embeddings": 4096}},
     "text_config.max_position_embeddings = 4096"),
    ({"llm_config": {"max_position_embeddings": 2048}}, "llm_config.max_position_embeddings = 2048"),
    ({"text_config": {}, "max_position_embeddings": 4096}, "max_position_embeddings = 4096"),
    ({"max_position_embeddings": 8192}, None),
    ({}, None),
])
def test_position_limit_is_the_text_models(hf, refused):
    from megatron_vlm.rl.rewards.model_reward import position_limit_refusal

    got = position_limit_refusal(hf, 8192, "/rm")
    assert (got is None) if refused is None else (refused in got), got
