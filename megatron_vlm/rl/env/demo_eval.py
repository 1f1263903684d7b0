"""Held-out accuracy of a tool demo's model: greedy conversations with its tool (or without), scored.

Why a separate evaluation: it scores an exported model outside a training run, both arms alike (`[rl.eval]` of an
[rl.env] run holds the same conversations, but the no-tool arm has no [rl.env]). This runs the same multi-turn loop the GRPO rollout runs (the built-in engine's `MultiTurnRollout`, the
environment in-process, the tool specs in the system turn as the rollout writes them) at temperature 0 on
prompts neither the SFT nor the GRPO saw, and scores the last model turn: `math` (the calculator demo: the last
number equals the answer) or `exact` (the zoom demo: the normalised text equals the answer). Without `--env`
every prompt is one model turn (the no-tool arm).

    python -m megatron_vlm.rl.env.demo_eval MODEL_DIR PROMPTS [--env calculator] [--reward math] [--columns ...]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_vlm.data.data_files import DataFileError
from megatron_vlm.rl.env.base import Environment, Observation, StepResult

__all__ = ["AnswerOnce", "evaluate_tool_demo"]


class AnswerOnce(Environment):
    """The no-tool arm's environment: the first model turn is the answer."""

    def step(self, action: str) -> StepResult:
        return StepResult(Observation(), done=True)


def _score(kind: str, text: str, answer: str) -> float:
    if kind == "math":
        from megatron_vlm.rl.rewards.verifiers import math_reward

        return math_reward(text, answer, fallback_last_number=True)
    if kind == "exact":
        return float(text.strip().strip(".").lower() == str(answer).strip().lower())
    raise ValueError(f"reward: 'math' or 'exact', got {kind!r}")


def evaluate_tool_demo(model_dir: str | Path, prompts: str | Path, *, env: Optional[str] = None,
                       env_kwargs: Optional[dict] = None, reward: str = "math", columns: Optional[dict] = None,
                       max_new_tokens: int = 96, max_turns: int = 3, max_total_tokens: int = 4096,
                       limit: int = 0, examples: int = 3) -> dict[str, Any]:
    """{"accuracy", "n", "turns_mean", "tool_calls", "tool_errors", "finish": {...}} of greedy conversations, and
    the first `examples` conversations as [model turns' texts, answer] (to see where the wrong ones go wrong)."""
    from megatron_vlm.checkpoint.hf import load_hf_model
    from megatron_vlm.data.processor import load_processor
    from megatron_vlm.inference.engine import SamplingParams
    from megatron_vlm.inference.multiturn import MultiTurnLimits, MultiTurnRollout
    from megatron_vlm.inference.policy_engine import PolicyRolloutEngine
    from megatron_vlm.rl.env.observation_limits import ObservationLimits
    from megatron_vlm.rl.env.pool import InlineEnvRunner, build_environment
    from megatron_vlm.rl.env.session import EnvSession, ToolPromptEncoder, env_sample
    from megatron_vlm.rl.env.turns import TurnEncoder
    from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
    from megatron_vlm.rl.prompts.encoder import PromptEncoder

    samples = load_prompt_dataset(prompts, columns=columns).samples  # before the model: a bad file fails at once
    model, proc = load_hf_model(str(model_dir)).eval(), load_processor(str(model_dir))
    if limit:
        samples = samples[:limit]
    name = env or f"{__name__}:AnswerOnce"
    tools = list(build_environment(name, env_kwargs).tools()) if env else []
    encoder = ToolPromptEncoder(PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=max_new_tokens,
                                              max_tokens=max_total_tokens), tools)
    encoded = [encoder.encode(s) for s in samples]
    keep = [i for i, p in enumerate(encoded) if p is not None]
    skipped = len(samples) - len(keep)
    samples = [samples[i] for i in keep]
    rollout_prompts = [p for p in encoded if p is not None]
    engine = PolicyRolloutEngine(model, proc.tokenizer)
    session = EnvSession(InlineEnvRunner(), TurnEncoder(proc), name=name, kwargs=dict(env_kwargs or {}),
                         samples=[env_sample(s, p) for s, p in zip(samples, rollout_prompts)],
                         histories=[encoder.messages(s) for s in samples], n=1, eos_token_ids=sorted(engine.eos_token_ids),
                         limits=ObservationLimits(max_frames=4))  # the prompts' max_frames
    limits = MultiTurnLimits(max_turns=max_turns if env else 1, max_total_tokens=max_total_tokens)
    with torch.no_grad():
        trajs = MultiTurnRollout(engine).generate(rollout_prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0),
                                                  session, limits, seed=0)
    session.settle(trajs)
    scores = [_score(reward, t.text, samples[t.prompt_index].answer) if not t.error else 0.0 for t in trajs]
    return {"accuracy": sum(scores) / max(1, len(scores)), "n": len(scores), "skipped": skipped,
            "turns_mean": sum(t.num_turns for t in trajs) / max(1, len(trajs)),
            "tool_calls": sum(t.info.get("tool_calls", 0.0) for t in trajs),
            "tool_errors": sum(t.info.get("tool_errors", 0.0) for t in trajs), "env_errors": session.errors,
            "finish": dict(Counter(t.finish_reason for t in trajs)),
            "examples": [[t.turn_texts, samples[t.prompt_index].answer] for t in trajs[:max(0, examples)]]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("prompts", help="a prompt file as [data] train_path takes it (parquet / jsonl)")
    p.add_argument("--env", default=None, help="the environment (e.g. calculator, zoom); none: one turn, no tools")
    p.add_argument("--env-kwargs", default="{}", help="JSON")
    p.add_argument("--reward", default="math", choices=("math", "exact"))
    p.add_argument("--columns", default=None, help='JSON, as [data] columns (e.g. {"prompt": "question", ...})')
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--examples", type=int, default=3, help="conversations to print")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    try:
        env_kwargs, columns = json.loads(a.env_kwargs), json.loads(a.columns) if a.columns else None
    except json.JSONDecodeError as e:
        p.error(f"--env-kwargs / --columns: not JSON ({e})")
    try:
        out = evaluate_tool_demo(a.model_dir, a.prompts, env=a.env, env_kwargs=env_kwargs, reward=a.reward,
                                 columns=columns, max_new_tokens=a.max_new_tokens, max_turns=a.max_turns,
                                 limit=a.limit, examples=a.examples)
    except DataFileError as e:  # a prompt file that does not open or whose columns need --columns: one line, exit 2
        print(f"error: prompts: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
