"""The environments' reset wait given up on one rank (its stop check: the env pool's `WaitAbandoned`), or failed
there (the runner itself raised), before the multi-turn loop starts: the rank must still join the loop's first
agreement of a tensor-parallel vLLM engine, whose other ranks would otherwise wait for it there
(`VLLMMultiTurnRollout.leave_together`; the loop agrees with or without a stop check)."""
import pytest
from multiturn_helpers import vqa_file

from megatron_vlm.abandon import WaitAbandoned
from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.data.processor import load_processor
from megatron_vlm.inference.engine import SamplingParams
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
from megatron_vlm.rl.env.config import RLEnvConfig
from megatron_vlm.rl.env.rollout import MultiTurnRounds
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
from megatron_vlm.rl.prompts.encoder import PromptEncoder
from megatron_vlm.rl.prompts.shard import EncodedShard
from megatron_vlm.testing.synthesize import synthesize_model_folder


class _ResetGivenUp:
    """An environment runner whose wait is given up at once (the rank is stopping)."""

    def run(self, calls, *, abandon=None):
        raise WaitAbandoned.of(len(calls), "environments")


class _RunnerBroke:
    """An environment runner that raises itself (not an error reply: e.g. its pool could not start a worker)."""

    def run(self, calls, *, abandon=None):
        raise RuntimeError("the runner broke")


class _Loop:
    """A multi-turn loop of a tensor-parallel engine: records `leave_together`; never asked to generate."""

    takes_abandon = True

    def __init__(self):
        self.left = []

    def leave_together(self, *, failed=False):
        self.left.append(failed)

    def generate(self, *a, **k):
        raise AssertionError("the loop runs after a reset given up")


@pytest.mark.parametrize(("abandon", "runner", "error"), [
    (lambda: True, _ResetGivenUp, "environment calls given up"), (None, _ResetGivenUp, "environment calls given up"),
    (None, _RunnerBroke, "the runner broke")], ids=["given_up", "given_up_no_stop_check", "runner_raised"])
def test_a_reset_given_up_joins_the_loops_agreement(tmp_path, abandon, runner, error):
    folder = synthesize_model_folder("tiny_qwen2_5_vl", tmp_path / "m", seed=0)
    model, proc = load_hf_model(str(folder)).eval(), load_processor(str(folder))
    samples = load_prompt_dataset(vqa_file(tmp_path / "vqa"), schema="messages").samples
    encoder = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=4, max_tokens=4096)
    prompts = [encoder.encode(s) for s in samples]
    engine = PolicyRolloutEngine(model, proc.tokenizer, EngineOptions(eos_token_ids={0}, max_num_seqs=3))
    rounds = MultiTurnRounds(RLEnvConfig(name="rl_env_fns_for_tests:RaiseOnReset", max_turns=2), engine, proc,
                             max_total_tokens=4096, runner=runner(), tools=[])
    rounds.rollout = loop = _Loop()
    with pytest.raises((WaitAbandoned, RuntimeError), match=error):
        rounds.generate(EncodedShard(samples, prompts), SamplingParams(max_new_tokens=4, n=2, temperature=1.0), seed=0,
                        **({"abandon": abandon} if abandon is not None else {}))
    assert loop.left == [runner is _RunnerBroke]  # joined once: saying failed for an error, stop for a give-up
