"""A trajectory whose environment failed at reset ends as env_error (not trained, counted in env/errors) however its
first model turn ended. The failure used to be reported only by `step`, which a first turn cut by a limit
(max_new_tokens: "length") never reaches: such a trajectory was trained as if its environment had run, its failure
in the session's error count (the round's warning) but not in env/errors."""
import pytest
from multiturn_helpers import vqa_file

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.data.processor import load_processor
from megatron_vlm.inference.engine import SamplingParams
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
from megatron_vlm.rl.env.config import RLEnvConfig
from megatron_vlm.rl.env.pool import InlineEnvRunner
from megatron_vlm.rl.env.rollout import MultiTurnRounds
from megatron_vlm.rl.env.trajectories import trajectory_metrics
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
from megatron_vlm.rl.prompts.encoder import PromptEncoder
from megatron_vlm.rl.prompts.shard import EncodedShard
from megatron_vlm.testing.synthesize import synthesize_model_folder

FNS = "rl_env_fns_for_tests"


@pytest.mark.parametrize("eos_every", [10**6, 2])  # turns cut at max_new_tokens; turns ended by EOS
def test_a_reset_failure_ends_the_trajectory_however_its_first_turn_ended(tmp_path, eos_every):
    folder = synthesize_model_folder("tiny_qwen2_5_vl", tmp_path / "m", seed=0)
    model, proc = load_hf_model(str(folder)).eval(), load_processor(str(folder))
    samples = load_prompt_dataset(vqa_file(tmp_path / "vqa"), schema="messages").samples
    encoder = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=4, max_tokens=4096)
    prompts = [encoder.encode(s) for s in samples]
    eos = set(range(0, model.lm_head.weight.shape[0], eos_every))
    engine = PolicyRolloutEngine(model, proc.tokenizer, EngineOptions(eos_token_ids=eos, max_num_seqs=3))
    cfg = RLEnvConfig(name=f"{FNS}:RaiseOnReset", max_turns=2)
    rounds = MultiTurnRounds(cfg, engine, proc, max_total_tokens=4096, runner=InlineEnvRunner(), tools=[])
    _, trajs = rounds.generate(EncodedShard(samples, prompts), SamplingParams(max_new_tokens=4, n=2, temperature=1.0),
                               seed=0)
    assert rounds.errors == 4
    assert [t.finish_reason for t in trajs] == ["env_error"] * 4, [t.finish_reason for t in trajs]
    assert all("no such level" in t.error for t in trajs)
    assert trajectory_metrics(trajs)["env/errors"] == 4.0
