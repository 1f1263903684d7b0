"""Multi-turn rollouts in asynchronous GRPO (built-in engine): a weight push into a running multi-turn `generate`
(the rollout rank's weight thread, `engine.paused()`) lands between two steps of the loop, and `interrupt()` ends
it; the trajectories carry the version of each model token, and the payload helpers give the trainer the
synchronous round's trajectories and rewards.

The pushed weights are a zero LM head: their distribution is uniform, a behaviour log-prob of exactly
-log(vocabulary size), which the random old weights never give, so the version labels can be checked against
the weights that drew the tokens."""
import math
import threading

import torch
from multiturn_helpers import vqa_file

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.data.processor import load_processor
from megatron_vlm.inference.engine import SamplingParams
from megatron_vlm.inference.multiturn import MultiTurnLimits, MultiTurnRollout
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
from megatron_vlm.rl.asynchronous.multiturn import add_trajectories, round_trajectories
from megatron_vlm.rl.env.pool import InlineEnvRunner
from megatron_vlm.rl.env.rollout import rollout_view
from megatron_vlm.rl.env.session import EnvSession, env_sample
from megatron_vlm.rl.env.turns import TurnEncoder
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
from megatron_vlm.rl.prompts.encoder import PromptEncoder
from megatron_vlm.testing.synthesize import synthesize_model_folder

ENV = "rl_env_fns_for_tests:Echo"


def _setup(tmp_path):
    folder = synthesize_model_folder("tiny_qwen2_5_vl", tmp_path / "m", seed=0)
    model, proc = load_hf_model(str(folder)).eval(), load_processor(str(folder))
    samples = load_prompt_dataset(vqa_file(tmp_path / "vqa"), schema="messages").samples
    encoder = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=8, max_tokens=4096)
    prompts = [encoder.encode(s) for s in samples]
    eos = set(range(0, model.lm_head.weight.shape[0], 4))
    engine = PolicyRolloutEngine(model, proc.tokenizer, EngineOptions(eos_token_ids=eos, max_num_seqs=4))

    def run(n=2, max_turns=4):
        session = EnvSession(InlineEnvRunner(), TurnEncoder(proc), name=ENV, kwargs={},
                             samples=[env_sample(s, p) for s, p in zip(samples, prompts)],
                             histories=[s.messages for s in samples], n=n, eos_token_ids=sorted(eos))
        return MultiTurnRollout(engine).generate(prompts, SamplingParams(max_new_tokens=8, n=n, temperature=1.0), session,
                                                 MultiTurnLimits(max_turns=max_turns, max_total_tokens=4096), seed=1)
    return model, engine, run


def test_push_during_multiturn_generation_switches_versions_at_a_step_boundary(tmp_path):
    model, engine, run = _setup(tmp_path)
    # uniform over the ids the engine draws from: all but the suppressed vision ones
    uniform = -math.log(model.lm_head.weight.shape[0] - len(engine.suppress_token_ids))
    calls, reached, pushed = [0], threading.Event(), {}

    def count(*_):
        calls[0] += 1
        if calls[0] == 6:
            reached.set()

    model.register_forward_hook(count)

    def push():  # the rollout rank's weight thread
        try:
            if reached.wait(120):
                with engine.paused():
                    with torch.no_grad():
                        model.lm_head.weight.zero_()
                    engine.load_weights(None, version=1)
                pushed["at"] = calls[0]
        except BaseException as e:  # noqa: BLE001 - reported below
            pushed["error"] = e

    pusher = threading.Thread(target=push)
    pusher.start()
    trajs = run()
    reached.set()
    pusher.join(120)
    assert "error" not in pushed and pushed.get("at", 0) >= 6, pushed
    spanning = 0
    for t in trajs:
        v = t.token_versions
        assert v.numel() == t.logprobs.numel() == int(t.model_mask.sum()) >= 1
        assert bool((v[1:] >= v[:-1]).all()), v  # never back to an older version
        assert t.policy_version == int(v.min())
        new = (v == 1).nonzero()
        if len(new) == 0:
            continue
        first = int(new[0])
        # the token drawn at the switch comes from the logits of the step before it (labelled with the version
        # current when it is drawn, as the single-turn engine does); from the next one on the new weights decide
        after = t.logprobs[first + 1:]
        assert torch.allclose(after, torch.full_like(after, uniform), atol=1e-5), (after, uniform)
        spanning += int(v[0]) == 0
        if first > 0:
            assert not torch.allclose(t.logprobs[:first], torch.full_like(t.logprobs[:first], uniform), atol=1e-3)
    assert spanning > 0  # the push landed in the middle of conversations
    assert rollout_view(trajs[0]).token_versions is trajs[0].token_versions  # what the staleness check reads


def test_interrupt_ends_the_multiturn_loop(tmp_path):
    model, engine, run = _setup(tmp_path)
    calls = [0]

    def count(*_):
        calls[0] += 1
        if calls[0] == 3:
            engine.interrupt()

    handle = model.register_forward_hook(count)
    trajs = run(max_turns=50)
    handle.remove()
    assert len(trajs) == 4 and {t.finish_reason for t in trajs} == {"interrupted"}
    assert not engine._interrupt.is_set()  # the next call starts afresh
    again = run(max_turns=2)
    assert len(again) == 4 and "interrupted" not in {t.finish_reason for t in again}


def test_payload_helpers_give_the_synchronous_rewards_and_trajectories(tmp_path):
    _, _, run = _setup(tmp_path)
    trajs = run(max_turns=2)
    payload = {"total": [1.0, 0.0, 0.5, 0.25], "per_reward": {"accuracy": [1.0, 0.0, 0.5, 0.25]}}
    add_trajectories(payload, {"trajectories": trajs, "env": [0.25, 0.5, 0.0, 1.0]})
    assert payload["total"] == [1.25, 0.5, 0.5, 1.25] and payload["per_reward"]["env"] == [0.25, 0.5, 0.0, 1.0]
    assert payload["per_reward"]["accuracy"] == [1.0, 0.0, 0.5, 0.25]
    # the trainer's groups (here in the other order): prompt indices become the trainer's group indices
    groups = [payload["trajectories"][2:], payload["trajectories"][:2]]
    mine = round_trajectories(groups)
    assert [t.prompt_index for t in mine] == [0, 0, 1, 1]
    assert [t.token_ids.tolist() for t in mine] == [t.token_ids.tolist() for t in trajs[2:] + trajs[:2]]
    assert round_trajectories([None, None]) is None
