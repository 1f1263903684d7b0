"""Rollout throughput: our policy engine with and without prefix sharing vs transformers `generate`.

Every completion runs to the budget (no EOS), so all three generate the same number of tokens;
sampling at temperature 1, on the same weights (our model exported to a Hugging Face folder and
loaded by transformers' own loader; one forward of both is compared first).

    ours (shared prefix)      PolicyRolloutEngine: each prompt prefilled once and copied into its G slots,
                              continuous batching over the slot cache, kernels.decode_attention
    ours (no sharing)         the same engine, every sample prefilled on its own
    transformers generate     Qwen2_5_VLForConditionalGeneration.generate(num_return_sequences=G), sdpa
    ours (CUDA graphs)        with --cuda-graphs (GPU only): the shared-prefix engine with cuda_graphs = "on",
                              decode steps replayed from CUDA graphs per batch-size bucket; the captures
                              (one per bucket, at the warm-up call: the engine keeps its cache and graphs
                              between calls of the same shape) are not in the timed rounds

Rows:
    (default, no GPU) CPU: a small Qwen2.5-VL shape (hidden 256, 4 layers, vocab 8k), 8 prompts x G = 8
                      x 64 new tokens, fp32. Target: ours >= 1.5x transformers.
    (default, GPU)    Qwen2.5-VL-3B shape (random weights, bf16), ~1k-token image prompts, G = 8,
                      512 new tokens. Target: >= 3x.
    --quick           a tiny model on the CPU (a smoke test for CI; its ratios say nothing).

Timing: wall clock around whole `generate` calls after one warm-up call each (synchronised on CUDA).
The three runs are interleaved round by round (ours, ours without sharing, transformers, then again)
so that load from other jobs on a shared machine hits them alike; the ratio ours / transformers is
taken per round and reported as min and median over `--repeats` rounds.

    python benchmarks/e2e/bench_rollout.py                 # GPU 3B row if CUDA, else the CPU row
    python benchmarks/e2e/bench_rollout.py --cpu           # the CPU row
    python benchmarks/e2e/bench_rollout.py --quick         # CPU smoke test
    python benchmarks/e2e/bench_rollout.py --cuda-graphs   # + the CUDA-graph row (needs a GPU)
    python benchmarks/e2e/bench_rollout.py --vllm          # ours vs the vLLM back end (in the vLLM venv: docs/vllm.md)
    python benchmarks/e2e/bench_rollout.py --engines ours,vllm --row a,b,c,d,e --threads 1
                                                           # the CPU rows vs vLLM's CPU build (rollout_engines_row.py,
                                                           # rollout_rows.py: a..e or their names, or all)

Shorter runs (a 15-minute GPU lease): `--prompts`, `--group`, `--new-tokens`, `--repeats` size the call, and
`--runs ours_shared_prefix,transformers_generate` leaves out the no-sharing engine (the target needs only
those two). The shape measured is in the JSON's `meta` (prompts, group, new_tokens, prompt_tokens) and in
the first printed line; the GPU suite's summary does not compare a smaller shape with the target's. Every
phase (model, export, load, each generate call) prints its seconds as it ends, and the JSON is written
with the meta at the start, so a run ended by a time limit still says how far it got.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams  # noqa: E402
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine  # noqa: E402
from megatron_vlm.models import build_model  # noqa: E402

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 151655, 151656, 151652, 151653
RUNS = ("ours_shared_prefix", "ours_no_sharing", "transformers_generate")


def qwen2_5_vl_3b_config(vocab: int = 151936) -> dict:
    """The published Qwen2.5-VL-3B-Instruct shapes (transformers-5 layout)."""
    from transformers import Qwen2_5_VLConfig

    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                         num_attention_heads=16, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=128000,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
                         bos_token_id=151643, eos_token_id=151645, pad_token_id=151643, tie_word_embeddings=True),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2),
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=True,
    )
    d = cfg.to_dict()
    d["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
    return d


def tiny_config() -> dict:
    from transformers import Qwen2_5_VLConfig

    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
                         bos_token_id=None, eos_token_id=1, pad_token_id=0),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]),
        image_token_id=1000, video_token_id=1001, vision_start_token_id=1002, vision_end_token_id=1003,
    )
    d = cfg.to_dict()
    d["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
    return d


def cpu_config() -> dict:
    """The CPU row's model: Qwen2.5-VL layout at a size a CPU decodes in seconds."""
    from transformers import Qwen2_5_VLConfig

    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
                         bos_token_id=None, eos_token_id=1, pad_token_id=0),
        vision_config=dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=256, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]),
        image_token_id=8000, video_token_id=8001, vision_start_token_id=8002, vision_end_token_id=8003,
    )
    d = cfg.to_dict()
    d["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
    return d


def positive_int(text: str) -> int:
    """argparse type of a count of timed rounds / steps: 0 would only fail at the end (a median of nothing), after the
    model build and warm-up (minutes of a GPU lease)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class NoDecode:
    """Token ids are not decoded: the benchmark has no tokenizer and no stop strings."""

    pad_token_id = 0
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return ""


def make_prompts(n: int, grid: tuple[int, int, int], text_tokens: int, cfg: dict, seed: int) -> list[RolloutPrompt]:
    g = torch.Generator().manual_seed(seed)
    vocab = cfg["text_config"]["vocab_size"]
    t, h, w = grid
    n_img = t * h * w // 4
    out = []
    for _ in range(n):
        special = min(cfg[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"))
        text = torch.randint(10, min(vocab, special), (text_tokens,), generator=g)  # plain text tokens only
        ids = torch.cat([text[:8], torch.tensor([cfg["vision_start_token_id"]] + [cfg["image_token_id"]] * n_img
                                                + [cfg["vision_end_token_id"]]), text[8:]])
        pixels = torch.randn(t * h * w, 3 * 2 * 14 * 14, generator=g)
        out.append(RolloutPrompt(ids, pixels, torch.tensor([list(grid)])))
    return out


def _timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def interleaved(fns: dict, device: str, repeats: int) -> dict[str, list[float]]:
    """Seconds per call of every function, one call of each per round, rounds interleaved (warm-up first)."""
    for name, fn in fns.items():
        print(f"warm-up {name}: {_timed(fn, device):.2f} s", flush=True)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(repeats):
        for name, fn in fns.items():
            times[name].append(_timed(fn, device))
            print(f"round {i + 1} {name}: {times[name][-1]:.2f} s", flush=True)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU (smoke test)")
    ap.add_argument("--cpu", action="store_true", help="the CPU row even when a GPU is present")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per generate call")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--json", type=str, default=None, help="also write the results here")
    ap.add_argument("--vllm", action="store_true", help="the vLLM row instead: our engine vs the vLLM back end on the "
                                                         "tiny Qwen2.5-VL folder (rollout_vllm_row.py; needs vllm)")
    ap.add_argument("--engines", default=None, help="comma-separated subset of ours,vllm: the CPU rows of --row instead "
                                                     "(rollout_engines_row.py; vllm needs the vLLM environment)")
    ap.add_argument("--row", default="all", help="with --engines: rows a..e (or names: rollout_rows.py), comma-separated, or all")
    ap.add_argument("--vllm-eager", action="store_true", help="with --engines: vLLM without torch inductor compilation")
    ap.add_argument("--cuda-graphs", action="store_true", help="also the engine with CUDA-graph decode steps (GPU only)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)} (transformers_generate "
                                                          "is always run: every ratio is against it)")
    args = ap.parse_args()
    wants_vllm = args.vllm or (args.engines is not None and "vllm" in args.engines.split(","))
    if wants_vllm:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:  # before any model is built: one line, no traceback
            print("skipped: vLLM is not installed here; run the vLLM rows in the vLLM environment (docs/vllm.md: "
                  "PYTHONPATH=$PWD $(bash .ci/vllm_env.sh | tail -1) benchmarks/e2e/bench_rollout.py ...)")
            return
    if args.engines is not None:
        from rollout_engines_row import parse_engines, run_engine_rows  # this script's folder is on sys.path
        from rollout_rows import resolve_rows

        try:
            resolve_rows(args.row), parse_engines(args.engines)
        except ValueError as e:
            ap.error(str(e))
        torch.set_num_threads(args.threads or 1)  # before vLLM starts: its CPU worker then refuses set_num_threads
        run_engine_rows(args)
        return
    if args.vllm:
        from rollout_vllm_row import run_vllm_row  # this script's folder is on sys.path

        if args.threads:
            torch.set_num_threads(args.threads)
        run_vllm_row(args)
        return
    runs_wanted = [r for r in args.runs.split(",") if r]
    unknown = [r for r in runs_wanted if r not in RUNS]
    if unknown:
        ap.error(f"--runs: unknown {unknown}; known: {list(RUNS)}")
    if not any(r.startswith("ours") for r in runs_wanted) and not args.cuda_graphs:
        ap.error("--runs: name at least one of our engines (ours_shared_prefix, ours_no_sharing) or pass --cuda-graphs")
    device = "cpu" if args.quick or args.cpu or not torch.cuda.is_available() else "cuda"
    if args.cuda_graphs and device != "cuda":
        ap.error("--cuda-graphs: needs a CUDA device (on the CPU the static steps run eagerly: nothing to measure)")
    if args.threads or args.quick:
        torch.set_num_threads(args.threads or 1)
    if args.quick:
        cfg, dtype, grid, text_tokens = tiny_config(), torch.float32, (1, 8, 8), 24
        prompts_n, new_tokens = args.prompts or 2, args.new_tokens or 16
        group = min(args.group, 4)
    elif device == "cpu":
        cfg, dtype, grid, text_tokens = cpu_config(), torch.float32, (1, 8, 8), 48
        prompts_n, new_tokens, group = args.prompts or 8, args.new_tokens or 64, args.group
    else:
        # ~1k-token prompt: a 56 x 64-patch image (896 merged tokens) + 104 text tokens
        cfg, dtype, grid, text_tokens = qwen2_5_vl_3b_config(), torch.bfloat16, (1, 56, 64), 104
        prompts_n, new_tokens, group = args.prompts or 4, args.new_tokens or 512, args.group
    t_phase = time.perf_counter()
    torch.manual_seed(0)
    model = build_model(cfg, dtype=dtype, device=device)
    model.init_weights()
    model.eval()
    prompts = make_prompts(prompts_n, grid, text_tokens, cfg, seed=1)
    params = SamplingParams(max_new_tokens=new_tokens, n=group, temperature=1.0)
    gen_tokens = prompts_n * group * new_tokens
    results = {}
    shape = {"prompts": prompts_n, "group": group, "new_tokens": new_tokens, "prompt_tokens": len(prompts[0])}
    print(f"shape: {prompts_n} prompts x G {group} x {new_tokens} new tokens, {len(prompts[0])}-token prompts, {dtype}; "
          f"model built in {time.perf_counter() - t_phase:.1f} s", flush=True)
    if args.json:  # the shape first: a run ended by a time limit still says what it was measuring
        Path(args.json).write_text(json.dumps({"meta": {**shape, "quick": args.quick, "partial": True}, "results": {}}, indent=2))

    def ours(share: bool, graphs: str = "off"):
        eng = PolicyRolloutEngine(model, NoDecode(),
                                  EngineOptions(eos_token_ids=[-1], share_prefix=share, device=device, cuda_graphs=graphs))
        gen = torch.Generator(device=device).manual_seed(0)
        return lambda: eng.generate(prompts, params, generator=gen)

    # the same weights in transformers: written as a Hugging Face folder by our exporter, read back by
    # transformers' own loader (which maps the hub key layout onto its modules)
    import tempfile

    import transformers
    from transformers import Qwen2_5_VLForConditionalGeneration

    from megatron_vlm.checkpoint.hf import save_hf_model

    t_phase = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_model(model, tmp)
        print(f"exported to a Hugging Face folder in {time.perf_counter() - t_phase:.1f} s", flush=True)
        t_phase = time.perf_counter()
        hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp, attn_implementation="sdpa", dtype=dtype).to(device).eval()
    print(f"loaded by transformers in {time.perf_counter() - t_phase:.1f} s", flush=True)
    longest = max(len(p) for p in prompts)
    ids = torch.full((prompts_n, longest), 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = p.input_ids
        mask[i, longest - len(p):] = 1
    mm = (ids == cfg["image_token_id"]).long()
    inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device), "mm_token_type_ids": mm.to(device),
              "pixel_values": torch.cat([p.pixel_values for p in prompts]).to(device, dtype),
              "image_grid_thw": torch.cat([p.image_grid_thw for p in prompts]).to(device)}

    with torch.no_grad():  # same weights: one forward of both models on the first prompt
        p0 = prompts[0]
        ours_logits = model(p0.input_ids[None].to(device), pixel_values=p0.pixel_values.to(device, dtype),
                            image_grid_thw=p0.image_grid_thw.to(device))[0, -1].float()
        one = {"input_ids": p0.input_ids[None].to(device), "mm_token_type_ids": (p0.input_ids[None] == cfg["image_token_id"]).long().to(device),
               "pixel_values": p0.pixel_values.to(device, dtype), "image_grid_thw": p0.image_grid_thw.to(device)}
        diff = (hf(**one).logits[0, -1].float() - ours_logits).abs().max().item()
    print(f"same weights check: max |logit difference| on one prompt = {diff:.3g}")

    def hf_generate():
        with torch.no_grad():
            return hf.generate(**inputs, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=group,
                               max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)

    runs = {"ours_shared_prefix": ours(True), "ours_no_sharing": ours(False), "transformers_generate": hf_generate}
    runs = {k: v for k, v in runs.items() if k in runs_wanted or k == "transformers_generate"}
    if args.cuda_graphs:
        runs["ours_cuda_graphs"] = ours(True, "on")
    times = interleaved(runs, device, args.repeats)
    for name, ts in times.items():
        s = statistics.median(ts)
        results[name] = {"seconds": s, "seconds_min": min(ts), "tokens_per_s": gen_tokens / s}
        print(f"{name:24s} {gen_tokens / s:10.1f} tok/s  (median {s:.3f} s, min {min(ts):.3f} s)", flush=True)
    if args.cuda_graphs and "ours_shared_prefix" in times:
        gain = [e / g for e, g in zip(times["ours_shared_prefix"], times["ours_cuda_graphs"])]
        results["ours_cuda_graphs"]["vs_eager_steps"] = statistics.median(gain)
        print(f"CUDA graphs / eager decode steps = median {statistics.median(gain):.2f}x, min {min(gain):.2f}x")
    for name in [n for n in times if n.startswith("ours")]:
        ratios = [h / o for o, h in zip(times[name], times["transformers_generate"])]  # per round
        results[name]["vs_transformers"] = statistics.median(ratios)
        results[name]["vs_transformers_min"] = min(ratios)
        # best call vs best call: the figure least disturbed by other jobs on a shared machine
        results[name]["vs_transformers_best"] = min(times["transformers_generate"]) / min(times[name])
        print(f"{name} / transformers generate = median {statistics.median(ratios):.2f}x, min {min(ratios):.2f}x "
              f"({len(ratios)} interleaved rounds); best call / best call {results[name]['vs_transformers_best']:.2f}x")
    # the per-step cost of rl.rollout.weights = "copy" on one device: refreshing an engine-owned copy
    # from the trainer's full weights (here: our model's state dict into a second model)
    import copy

    copy_engine = PolicyRolloutEngine(copy.deepcopy(model), NoDecode(), EngineOptions(eos_token_ids=[-1], device=device),
                                      sync_from=model)
    refresh = []
    for version in range(3):
        copy_engine.load_weights(None, version=version)
        if device == "cuda":
            torch.cuda.synchronize()
        refresh.append(copy_engine.weight_sync_s)
        copy_engine.weight_sync_s = 0.0
    results["weight_refresh"] = {"seconds": statistics.median(refresh)}
    first = next(n for n in times if n.startswith("ours"))
    print(f"weight refresh (copy mode, one device): {statistics.median(refresh) * 1e3:.1f} ms per step "
          f"= {statistics.median(refresh) / results[first]['seconds']:.1%} of one generate call ({first})")
    if "ours_shared_prefix" in results and "ours_no_sharing" in results:
        share_gain = results["ours_shared_prefix"]["tokens_per_s"] / results["ours_no_sharing"]["tokens_per_s"]
        print(f"prefix sharing speed-up = {share_gain:.2f}x")
    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else
        f"cpu ({platform.processor() or 'unknown'}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f})",
        "torch": torch.__version__, "transformers": transformers.__version__, "dtype": str(dtype), "quick": args.quick, **shape,
        "repeats": args.repeats, "runs": list(times), "date": time.strftime("%Y-%m-%d"), "max_logit_diff_vs_transformers": diff,
    }
    print(json.dumps(meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
