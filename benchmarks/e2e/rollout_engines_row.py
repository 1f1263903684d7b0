"""`bench_rollout.py --engines ours,vllm --row a..e`: the built-in engine vs vLLM's CPU build, row by row.

Why this protocol: the two engines are compared as a GRPO step uses them. Both load the same Hugging Face
folder (random fp32 weights, written once per row), get the same prompts (random token ids; the image
row: synthetic-VQA images, which vLLM processes itself and ours gets as pixel values), sample at
temperature 1 with G completions per prompt, return the behaviour log-prob of every token, and run every
completion to its budget (EOS ignored: ours with no EOS id, vLLM with `ignore_eos`). vLLM runs in this
process (its in-process engine core, `VLLM_ENABLE_V1_MULTIPROCESSING=0`) with its CPU defaults otherwise:
torch inductor compilation (`--vllm-eager` turns it off), its CPU attention kernels, prefix caching (the G
completions share the prompt's blocks), no per-request seed. Its prefix and multimodal caches are reset
before every call (outside the timing): a GRPO step's prompts and weights are new, so a cache hit from the
previous round would be a result no rollout gets. Both run on the same torch threads (`--threads`, set
before vLLM starts; `VLLM_CPU_OMP_THREADS_BIND=nobind` so vLLM does not re-pin them).

Timing: one warm-up call each (vLLM's first call compiles), then `--repeats` rounds; each round calls both,
the order alternating (ours first in odd rounds), and the ratio ours / vLLM of tokens per second is taken
per round; min and median are reported, with the 1-minute load average of every round. Each call is timed
on two clocks: the wall clock, and the process CPU clock (`time.process_time`, all threads of this process:
vLLM's in-process engine core included). On a machine shared with other jobs the wall clock of a call
also counts the time the scheduler gave the core to someone else, which swings 2-4x between rounds; the
CPU clock counts only the work done, so its ratio is the stable one (on an idle machine, one thread, the
two agree). For rows with `gemm_rate`, the fp32 matmul rate of this CPU (a 1024^3 `torch.mm` on the same
threads, best of 5 on the CPU clock, measured before and after the row, the higher kept) is the limit the
decode step's achieved GEMM rate (weight-GEMM FLOPs / decode seconds, from our engine's own decode timer,
scaled to the CPU clock by the call's CPU / wall ratio) is compared with; vLLM has no such timer, so the
call-level rate (prefill + decode weight-GEMM FLOPs / call CPU seconds) is given for both.
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
from rollout_rows import RowSpec, decode_flops, linear_flops_per_token, resolve_rows, text_hf_config

ENGINES = ("ours", "vllm")


class _NoDecode:
    """Our engine's tokenizer for the text rows: ids are never decoded (no stop strings, no EOS)."""

    pad_token_id = 0
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return ""


def parse_engines(text: str) -> list[str]:
    """`--engines`: a comma-separated subset of ours,vllm (ValueError on anything else or nothing)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in items if t not in ENGINES]
    if unknown or not items:
        raise ValueError(f"--engines: unknown {unknown or text!r}; known: {','.join(ENGINES)}")
    return list(dict.fromkeys(items))


def matmul_rate(n: int = 1024, reps: int = 5) -> float:
    """This CPU's fp32 GEMM rate on torch's current threads: FLOP/s of the best of `reps` [n, n] x [n, n] products,
    each timed on the process CPU clock (time other jobs take from this core is not counted)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        torch.mm(a, b)
        best = min(best, time.process_time() - t0)
    return 2 * n**3 / best


def _text_row(spec: RowSpec, folder: Path):
    from megatron_vlm.inference.engine import RolloutPrompt
    from megatron_vlm.testing.folders import save_random_model

    cfg = text_hf_config(spec)
    save_random_model(cfg, folder, seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [RolloutPrompt(torch.randint(10, spec.vocab - 10, (spec.prompt_tokens,), generator=g)) for _ in range(spec.prompts)]
    requests = [{"prompt_token_ids": p.input_ids.tolist()} for p in prompts]
    return cfg, prompts, requests, _NoDecode(), {}


def _image_row(spec: RowSpec, folder: Path, tmp: Path):
    from megatron_vlm.data.processor import load_processor
    from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa
    from megatron_vlm.inference.vllm_engine import collapse_placeholders
    from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
    from megatron_vlm.rl.prompts.encoder import PromptEncoder
    from megatron_vlm.testing.synthesize import synthesize_model_folder

    synthesize_model_folder("tiny_qwen2_5_vl", folder, seed=0)
    pre = json.loads((folder / "preprocessor_config.json").read_text())  # the tiny folder caps images at 16 tokens
    pre["size"]["longest_edge"] = 28 * 28 * spec.image_tokens  # both engines read this file
    (folder / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    proc = load_processor(str(folder))
    side = 28 * int(spec.image_tokens**0.5)  # 64 merged tokens: 16 x 16 patches of 14 px
    vqa = write_synthetic_vqa(tmp / "vqa", spec.prompts, spec.prompts, seed=0, image_size=side)["eval"]
    encoder = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=spec.new_tokens, max_tokens=4096)
    prompts = [p for p in (encoder.encode(s) for s in load_prompt_dataset(vqa, schema="messages").samples) if p][:spec.prompts]
    n_img = [int((p.input_ids == proc.image_token_id).sum()) for p in prompts]
    if n_img != [spec.image_tokens] * spec.prompts:
        raise RuntimeError(f"row {spec.letter}: image tokens per prompt {n_img}, wanted {spec.image_tokens}")
    requests = [{"prompt_token_ids": collapse_placeholders(p.input_ids.tolist(), {proc.image_token_id}),
                 "multi_modal_data": {"image": p.images[0]}} for p in prompts]
    cfg = json.loads((folder / "config.json").read_text())
    special = sorted({cfg[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")})
    return cfg, prompts, requests, proc.tokenizer, {t: -100.0 for t in special}  # ours never samples them either


def _vllm(folder: Path, spec: RowSpec, max_len: int, eager: bool, text: bool):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM

    return LLM(model=str(folder), dtype=torch.float32, seed=0, max_model_len=max_len, enforce_eager=eager,
               max_num_seqs=max(256, spec.prompts * spec.group), distributed_executor_backend="uni",
               skip_tokenizer_init=text, enable_prefix_caching=True)


def _close(llm) -> None:
    """Shut vLLM down and clear its process-wide parallel state (the next row starts a new engine)."""
    import gc

    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    llm.llm_engine.engine_core.shutdown()
    gc.collect()
    destroy_model_parallel()
    destroy_distributed_environment()


def prepare_row(spec: RowSpec, engines: list[str], args, tmp: Path, out: dict) -> tuple[dict, dict]:
    """Write the row's folder and prompts into `tmp`, start the engines; returns ({engine: call}, info) where a
    call returns (generated tokens, seconds, our engine's stats or {}) and info holds cfg, prompt_tokens, close."""
    from megatron_vlm.checkpoint.hf import load_hf_model
    from megatron_vlm.inference.engine import SamplingParams
    from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine

    folder = tmp / "model"
    if spec.model_type == "qwen2_5_vl":
        cfg, prompts, requests, tokenizer, bias = _image_row(spec, folder, tmp)
    else:
        cfg, prompts, requests, tokenizer, bias = _text_row(spec, folder)
    prompt_tokens = len(prompts[0])
    out.update(prompt_tokens=prompt_tokens, generated_tokens=spec.generated_tokens)
    print(f"prompts: {prompt_tokens} tokens each", flush=True)
    params = SamplingParams(max_new_tokens=spec.new_tokens, n=spec.group, temperature=1.0)
    calls: dict = {}
    info: dict = {"cfg": cfg, "prompt_tokens": prompt_tokens, "close": lambda: None}
    if "ours" in engines:
        model = load_hf_model(str(folder), dtype=torch.float32, device="cpu").eval()
        ours = PolicyRolloutEngine(model, tokenizer, EngineOptions(eos_token_ids=[-1]))
        gen = torch.Generator().manual_seed(0)

        def run_ours():
            r = ours.generate(prompts, params, generator=gen)
            return r.num_generated_tokens, r.seconds, r.stats
        calls["ours"] = run_ours
    if "vllm" in engines:
        from vllm import SamplingParams as VSP

        t0 = time.perf_counter()
        llm = _vllm(folder, spec, prompt_tokens + spec.new_tokens + 64, args.vllm_eager, spec.model_type != "qwen2_5_vl")
        out["vllm_start_s"] = time.perf_counter() - t0
        print(f"vLLM engine up in {out['vllm_start_s']:.1f} s", flush=True)
        vsp = VSP(n=spec.group, temperature=1.0, top_p=1.0, top_k=0, max_tokens=spec.new_tokens, ignore_eos=True,
                  logprobs=0, detokenize=False, logit_bias=bias or None)

        def run_vllm():
            llm.reset_prefix_cache()
            llm.reset_mm_cache()
            t0 = time.perf_counter()
            res = llm.generate(requests, sampling_params=vsp, use_tqdm=False)
            s = time.perf_counter() - t0
            return sum(len(c.token_ids) for o in res for c in o.outputs), s, {}
        calls["vllm"] = run_vllm
        info["close"] = lambda: _close(llm)
    return calls, info


def run_row(spec: RowSpec, engines: list[str], args) -> dict:
    """Interleaved rounds of the row's call on each engine; returns the row's numbers (also printed)."""
    print(f"== row {spec.letter} ({spec.name}): {spec.prompts} prompts x G {spec.group} x {spec.new_tokens} new, fp32, "
          f"{torch.get_num_threads()} threads; load {os.getloadavg()[0]:.2f}", flush=True)
    out: dict = {"row": spec.letter, "name": spec.name, "load_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as tmp:
        calls, info = prepare_row(spec, engines, args, Path(tmp), out)
        cfg, prompt_tokens = info["cfg"], info["prompt_tokens"]
        for name, fn in calls.items():
            n, s, _ = fn()
            print(f"warm-up {name}: {s:.2f} s, {n} tokens", flush=True)
            out[f"{name}_first_call_s"] = s
        peak_before = matmul_rate() if spec.gemm_rate else 0.0
        rates: dict[str, list[float]] = {k: [] for k in calls}
        cpu_rates: dict[str, list[float]] = {k: [] for k in calls}
        decode: list[tuple[float, float]] = []  # ours: (decode seconds on the CPU clock, decode steps) per round
        loads: list[float] = []
        for i in range(args.repeats):
            order = list(calls) if i % 2 == 0 else list(reversed(calls))
            for name in order:
                c0 = time.process_time()
                n, s, stats = calls[name]()
                cpu = time.process_time() - c0
                if n != spec.generated_tokens:
                    raise RuntimeError(f"row {spec.letter}: {name} generated {n} tokens, expected {spec.generated_tokens}")
                rates[name].append(n / s)
                cpu_rates[name].append(n / cpu)
                if stats:
                    decode.append((stats["decode_s"] * min(1.0, cpu / s), stats["decode_steps"]))
            loads.append(os.getloadavg()[0])
            print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s ({cpu_rates[k][-1]:.1f} per CPU s)"
                                                 for k, v in rates.items()) + f" (load {loads[-1]:.2f})", flush=True)
        peak = max(peak_before, matmul_rate()) if spec.gemm_rate else 0.0
        info["close"]()
    out["loads"] = loads
    for name, r in rates.items():
        c = cpu_rates[name]
        out[name] = {"tokens_per_s": statistics.median(r), "tokens_per_s_min": min(r), "tokens_per_s_max": max(r), "rounds": r,
                     "tokens_per_cpu_s": statistics.median(c), "tokens_per_cpu_s_min": min(c), "cpu_rounds": c}
    if len(rates) == 2:
        for key, rr in (("ours_vs_vllm", rates), ("ours_vs_vllm_cpu", cpu_rates)):
            ratios = [o / v for o, v in zip(rr["ours"], rr["vllm"])]
            out[key] = {"median": statistics.median(ratios), "min": min(ratios), "rounds": ratios}
    if spec.gemm_rate:
        out["gemm"] = _gemm(spec, cfg, prompt_tokens, cpu_rates, decode, peak)
    _print_row(spec, out)
    return out


def _gemm(spec: RowSpec, cfg: dict, prompt_tokens: int, cpu_rates: dict, decode: list, peak: float) -> dict:
    """Achieved weight-GEMM FLOP/s on the CPU clock (so other jobs' load does not count as our time) vs `peak`."""
    lin_dec, attn_dec = decode_flops(spec, cfg, prompt_tokens)
    per_tok = linear_flops_per_token(cfg)
    g: dict = {"matmul_peak_gflops": peak / 1e9, "linear_gflop_per_token": per_tok / 1e9,
               "decode_linear_gflop": lin_dec / 1e9, "decode_attention_gflop": attn_dec / 1e9}
    if decode:
        s, steps = statistics.median(d[0] for d in decode), decode[0][1]
        g.update(ours_decode_step_ms=1e3 * s / steps, ours_decode_gemm_gflops=lin_dec / s / 1e9,
                 ours_decode_fraction_of_peak=lin_dec / s / peak)
    # call level (both engines): weight-GEMM FLOPs of the prefill (the prompts once: both share the prompt
    # across G) and of every decode step, over the call's CPU seconds
    call_flops = per_tok * (spec.prompts * prompt_tokens + spec.prompts * spec.group * (spec.new_tokens - 1))
    for name, r in cpu_rates.items():
        secs = spec.generated_tokens / statistics.median(r)
        g[f"{name}_call_gemm_gflops"] = call_flops / secs / 1e9
        g[f"{name}_call_fraction_of_peak"] = call_flops / secs / peak
    return g


def _print_row(spec: RowSpec, out: dict) -> None:
    for name in ENGINES:
        if name in out:
            o = out[name]
            print(f"row {spec.letter} {name:5s} {o['tokens_per_s']:9.1f} tok/s (median; min {o['tokens_per_s_min']:.1f}, "
                  f"max {o['tokens_per_s_max']:.1f})", flush=True)
    for key, clock in (("ours_vs_vllm", "wall clock"), ("ours_vs_vllm_cpu", "CPU clock")):
        if key in out:
            r = out[key]
            print(f"row {spec.letter} ours / vllm ({clock}) = median {r['median']:.2f}x, min {r['min']:.2f}x "
                  f"({len(r['rounds'])} interleaved rounds; loads {', '.join(f'{x:.1f}' for x in out['loads'])})", flush=True)
    if "gemm" in out:
        g = out["gemm"]
        line = f"row {spec.letter} fp32 matmul peak {g['matmul_peak_gflops']:.1f} GFLOP/s"
        if "ours_decode_gemm_gflops" in g:
            line += (f"; ours decode step {g['ours_decode_step_ms']:.1f} ms: {g['ours_decode_gemm_gflops']:.1f} GFLOP/s = "
                     f"{g['ours_decode_fraction_of_peak']:.0%} of peak")
        for name in ENGINES:
            if f"{name}_call_gemm_gflops" in g:
                line += f"; {name} whole call {g[f'{name}_call_gemm_gflops']:.1f} GFLOP/s ({g[f'{name}_call_fraction_of_peak']:.0%})"
        print(line, flush=True)


def run_engine_rows(args) -> dict:
    """The rows `--row` names on the engines `--engines` names; writes `--json` after every row."""
    rows, engines = resolve_rows(args.row), parse_engines(args.engines)
    meta = {"engines": engines, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "repeats": args.repeats,
            "vllm_compiled": not args.vllm_eager}
    if "vllm" in engines:
        import vllm

        meta["vllm"] = vllm.__version__
    import transformers

    meta["transformers"] = transformers.__version__
    print(json.dumps(meta), flush=True)
    results: dict = {}
    for spec in rows:
        results[spec.name] = run_row(spec, engines, args)
        if args.json:
            Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return results
