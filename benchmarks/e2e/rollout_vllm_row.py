"""bench_rollout.py's vLLM row (`--vllm`): our engine vs the vLLM back end on the same weights and prompts.

Why a folder and real images: vLLM loads a Hugging Face folder and processes the images itself, so both
engines get the tiny Qwen2.5-VL folder `model.synthesize` writes (random weights, tokenizer, processor) and
synthetic-VQA image prompts encoded by the GRPO prompt encoder (vLLM receives the images, ours their
pixel values). Sampling at temperature 1 with G completions per prompt; the calls are interleaved round by
round and the ratio vLLM / ours (tokens per second, each engine's own generated-token count) is taken per
round (min and median). Runs where vllm imports (the environment docs/vllm.md builds).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch


def run_vllm_row(args) -> dict:
    from megatron_vlm.checkpoint.hf import load_hf_model
    from megatron_vlm.data.processor import load_processor
    from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa
    from megatron_vlm.inference.engine import SamplingParams
    from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
    from megatron_vlm.inference.stopping import eos_token_ids_of
    from megatron_vlm.inference.vllm_engine import VLLMRolloutEngine
    from megatron_vlm.rl.config import VLLMConfig
    from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
    from megatron_vlm.rl.prompts.encoder import PromptEncoder
    from megatron_vlm.testing.synthesize import synthesize_model_folder

    new_tokens, group, n_prompts = args.new_tokens or 32, args.group, args.prompts or 8
    with tempfile.TemporaryDirectory() as tmp:
        folder = synthesize_model_folder("tiny_qwen2_5_vl", Path(tmp) / "m", seed=0)
        proc = load_processor(str(folder))
        vqa = write_synthetic_vqa(Path(tmp) / "vqa", n_prompts, n_prompts, seed=0)["eval"]
        encoder = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=new_tokens, max_tokens=1024)
        prompts = [p for p in (encoder.encode(s) for s in load_prompt_dataset(vqa, schema="messages").samples) if p][:n_prompts]
        model = load_hf_model(str(folder), dtype=torch.float32, device="cpu").eval()
        eos = sorted(eos_token_ids_of(proc.tokenizer))
        ours = PolicyRolloutEngine(model, proc.tokenizer, EngineOptions(eos_token_ids=eos))
        t0 = time.perf_counter()
        vllm = VLLMRolloutEngine(str(folder), VLLMConfig(max_num_seqs=max(16, n_prompts * group)), dtype=torch.float32,
                                 device="cpu", max_model_len=1024, seed=0, eos_token_ids=eos, placeholder_ids=[proc.image_token_id])
        print(f"vLLM engine up in {time.perf_counter() - t0:.1f} s", flush=True)
        params = SamplingParams(max_new_tokens=new_tokens, n=group, temperature=1.0)
        calls = {"ours_shared_prefix": lambda: ours.generate(prompts, params, generator=torch.Generator().manual_seed(0)),
                 "vllm": lambda: vllm.generate(prompts, params, generator=torch.Generator().manual_seed(0))}
        t0 = time.perf_counter()
        vllm.load_weights({k: v for b in _buckets(model) for k, v in b}, version=1)  # one push of the same weights
        push_s = time.perf_counter() - t0
        rates: dict[str, list[float]] = {k: [] for k in calls}
        for name, fn in calls.items():
            r = fn()
            print(f"warm-up {name}: {r.seconds:.2f} s, {r.num_generated_tokens} tokens", flush=True)
        for i in range(args.repeats):
            for name, fn in calls.items():
                r = fn()
                rates[name].append(r.num_generated_tokens / r.seconds)
                print(f"round {i + 1} {name}: {r.seconds:.2f} s, {rates[name][-1]:.1f} tok/s", flush=True)
        vllm.close()
    ratios = [v / o for o, v in zip(rates["ours_shared_prefix"], rates["vllm"])]
    results = {name: {"tokens_per_s": statistics.median(r), "tokens_per_s_max": max(r)} for name, r in rates.items()}
    results["vllm"].update(vs_ours=statistics.median(ratios), vs_ours_min=min(ratios), weight_push_s=push_s)
    import vllm as vllm_pkg

    meta = {"device": f"cpu ({platform.processor() or 'unknown'}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f})",
            "vllm": vllm_pkg.__version__, "torch": torch.__version__, "prompts": len(prompts), "group": group,
            "new_tokens": new_tokens, "prompt_tokens": len(prompts[0]), "repeats": args.repeats, "date": time.strftime("%Y-%m-%d")}
    print(f"vllm / ours = median {statistics.median(ratios):.2f}x, min {min(ratios):.2f}x ({len(ratios)} interleaved rounds); "
          f"weight push {push_s:.2f} s")
    print(json.dumps(meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return results


def _buckets(model):
    from megatron_vlm.inference.vllm_weights import hf_weight_buckets

    return hf_weight_buckets(model, 64 << 20)
