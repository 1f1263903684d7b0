"""Multi-turn rollouts: the KV cache kept across turns vs prefilling the whole history again every turn.

    kept cache      MultiTurnRollout: after each environment turn only its tokens (and the turn's last sampled
                    token) are prefilled into the conversation's slot (inference/multiturn.py), the replies of
                    one iteration in one forward
    re-prefilled    the same loop with `reprefill_history=True`: the prompt, every earlier turn and the new
                    one prefilled from an empty cache after each environment turn (an engine without a cache
                    across turns), images through the vision tower again; the replies of one iteration
                    left-padded into one forward too

Same tokens in both (per-conversation generators; tests/unit/rl/test_multiturn_limits.py checks it), so the
ratio is the cost of the history. Setup: a random Qwen2.5-VL (hidden 256, 4 layers, fp32; `--tiny`: the test
model), 8 synthetic VQA prompts with an image each x G = 4, an environment that answers every turn with a fixed
sentence (no tool work to time), `--turns` model turns per trajectory, every third token id ends a turn (short
turns, as tool calls are). Runs are interleaved round by round; the ratio re-prefilled / kept is taken per round
and reported as min and median over `--repeats` rounds, with the prefilled token counts.

    python benchmarks/e2e/bench_multiturn.py [--turns 6] [--repeats 5] [--tiny]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_vlm.checkpoint.hf import load_hf_model  # noqa: E402
from megatron_vlm.data.processor import load_processor  # noqa: E402
from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa  # noqa: E402
from megatron_vlm.inference.engine import SamplingParams  # noqa: E402
from megatron_vlm.inference.multiturn import MultiTurnLimits, MultiTurnRollout  # noqa: E402
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine  # noqa: E402
from megatron_vlm.rl.env.base import Environment, Observation, StepResult  # noqa: E402
from megatron_vlm.rl.env.pool import InlineEnvRunner  # noqa: E402
from megatron_vlm.rl.env.session import EnvSession, env_sample  # noqa: E402
from megatron_vlm.rl.env.turns import TurnEncoder  # noqa: E402
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset  # noqa: E402
from megatron_vlm.rl.prompts.encoder import PromptEncoder  # noqa: E402
from megatron_vlm.testing.folders import save_random_model  # noqa: E402
from megatron_vlm.testing.synthesize import synthesize_model_folder  # noqa: E402
from megatron_vlm.testing.tiny_model import tiny_qwen2_5_vl_hf_config  # noqa: E402
from megatron_vlm.testing.tiny_processor import build_tiny_qwen2_5_vl_processor, tiny_qwen2_5_vl_text_config_ids  # noqa: E402


class Reply(Environment):
    """Answers every turn with the same sentence; never done (the turn limit ends the trajectory)."""

    def step(self, action):
        return StepResult(Observation(text="that is not it yet, look again at the picture and answer"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    if args.tiny:
        folder = synthesize_model_folder("tiny_qwen2_5_vl", tmp / "model", seed=0)
    else:  # the tiny model's tokenizer and processor, a larger decoder
        folder = tmp / "model"
        processor = build_tiny_qwen2_5_vl_processor(folder)
        cfg = tiny_qwen2_5_vl_hf_config(tiny_qwen2_5_vl_text_config_ids(processor), hidden=256, layers=4)
        cfg["text_config"]["num_attention_heads"] = 8  # head_dim 32, as the tiny model's (M-RoPE sections 4, 6, 6)
        cfg["text_config"]["num_key_value_heads"] = 4
        save_random_model(cfg, folder, 0)
    model, proc = load_hf_model(str(folder)).eval(), load_processor(str(folder))
    vqa = write_synthetic_vqa(tmp / "vqa", args.prompts, args.prompts, seed=0)["eval"]
    samples = load_prompt_dataset(vqa, schema="messages").samples[: args.prompts]
    encoder = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=16, max_tokens=4096)
    prompts = [encoder.encode(s) for s in samples]
    eos = set(range(0, model.lm_head.weight.shape[0], 3))
    engine = PolicyRolloutEngine(model, proc.tokenizer, EngineOptions(eos_token_ids=eos))
    params = SamplingParams(max_new_tokens=16, n=args.group, temperature=1.0)
    limits = MultiTurnLimits(max_turns=args.turns, max_total_tokens=4096)
    module = sys.modules[__name__]
    module.Reply = Reply  # resolvable by dotted path below

    def run(reprefill: bool):
        session = EnvSession(InlineEnvRunner(), TurnEncoder(proc), name=f"{__name__}:Reply", kwargs={},
                             samples=[env_sample(s, p) for s, p in zip(samples, prompts)],
                             histories=[s.messages for s in samples], n=args.group, eos_token_ids=sorted(eos))
        loop = MultiTurnRollout(engine, reprefill_history=reprefill)
        t0 = time.perf_counter()
        trajs = loop.generate(prompts, params, session, limits, seed=0)
        return time.perf_counter() - t0, loop.stats, trajs

    run(False), run(True)  # warm-up
    kept, again, ratios = [], [], []
    for _ in range(args.repeats):
        a, sa, ta = run(False)
        b, sb, tb = run(True)
        assert [t.token_ids.tolist() for t in ta] == [t.token_ids.tolist() for t in tb]
        kept.append(a)
        again.append(b)
        ratios.append(b / a)
    out = {"meta": {"model": "tiny" if args.tiny else "hidden 256, 4 layers", "prompts": args.prompts,
                    "group": args.group, "turns": args.turns, "repeats": args.repeats,
                    "prompt_tokens": [len(p) for p in prompts][:3],
                    "mean_turns": sum(t.num_turns for t in ta) / len(ta),
                    "mean_trajectory_tokens": sum(int(t.token_ids.numel()) for t in ta) / len(ta)},
           "kept_cache_s": {"min": min(kept), "median": statistics.median(kept)},
           "reprefilled_s": {"min": min(again), "median": statistics.median(again)},
           "ratio_reprefilled_over_kept": {"min": min(ratios), "median": statistics.median(ratios)},
           "prefilled_tokens_after_turns": {"kept": sa["append_tokens"], "reprefilled": sb["append_tokens"]}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
