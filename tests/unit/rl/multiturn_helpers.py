"""Shared set-up of the multi-turn tests: a tiny family model, the synthetic VQA prompts, an engine whose turns
end after a few tokens, and the environment session (in-process runner unless given)."""

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.data.processor import load_processor
from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa
from megatron_vlm.inference.engine import SamplingParams
from megatron_vlm.inference.multiturn import MultiTurnLimits, MultiTurnRollout
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
from megatron_vlm.rl.env.pool import InlineEnvRunner
from megatron_vlm.rl.env.session import EnvSession, env_sample
from megatron_vlm.rl.env.turns import TurnEncoder
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
from megatron_vlm.rl.prompts.encoder import PromptEncoder
from megatron_vlm.testing.synthesize import synthesize_model_folder

ENV = "rl_env_fns_for_tests:ImageSecondTurn"


def vqa_file(folder):
    """Two synthetic VQA prompts (with an image each)."""
    return write_synthetic_vqa(folder, 2, 2, seed=0)["eval"]


def rollout(kind, vqa, tmp_path, *, env=ENV, kwargs=None, runner=None, reprefill=False, eos_every=2, max_turns=3, max_total=4096, max_new=12, n=2, seed=0,
            record_routes=False, cuda_graphs="off", engine=None):
    """`engine`: an engine of an earlier call with the same `tmp_path` (its model, options and kept state) instead of
    a new one."""
    folder = tmp_path / kind
    if engine is None:
        folder = synthesize_model_folder(kind, tmp_path / kind, seed=0)
    model, proc = engine.model if engine is not None else load_hf_model(str(folder)).eval(), load_processor(str(folder))
    encoder = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=max_new, max_tokens=max_total)
    samples = load_prompt_dataset(vqa, schema="messages").samples
    prompts = [encoder.encode(s) for s in samples]
    # every even token id ends a turn (eos_every = 2): turns of a few tokens from a random model
    vocab = model.lm_head.weight.shape[0]
    eos = set(range(0, vocab, eos_every))
    options = EngineOptions(eos_token_ids=eos, max_num_seqs=3, record_routes=record_routes, cuda_graphs=cuda_graphs)
    engine = engine or PolicyRolloutEngine(model, proc.tokenizer, options)
    session = EnvSession(runner or InlineEnvRunner(), TurnEncoder(proc), name=env, kwargs=kwargs or {},
                         samples=[env_sample(s, p) for s, p in zip(samples, prompts)],
                         histories=[s.messages for s in samples], n=n, eos_token_ids=sorted(eos))
    loop = MultiTurnRollout(engine, reprefill_history=reprefill)
    trajs = loop.generate(prompts, SamplingParams(max_new_tokens=max_new, n=n, temperature=1.0),
                                              session, MultiTurnLimits(max_turns=max_turns, max_total_tokens=max_total),
                                              seed=seed)
    session.engine_stats = dict(loop.stats)  # what the engine prefilled and stepped
    session.engine = engine
    return model, prompts, trajs, session
