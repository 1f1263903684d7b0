"""Host cost of one SFT step: the Qwen2.5-VL-3B structure at tiny widths on the CPU, where kernels are nearly free.

Why: on a GPU the compiled 16k-token 3B step leaves the GPU waiting on the host for a quarter of the step
(benchmarks/RESULTS.md). The host's share — Python dispatch of every op, FSDP2's hooks, the checkpoint wrapper,
compiled-region guards, the optimizer launch, host reads of device values — does not depend on the widths; it
depends on the structure (36 decoder layers, 32 vision blocks, the same module classes, FSDP units, checkpointing
and compile as the training job). Built at hidden 64 with a short pack, the step's kernels take a few
milliseconds on the CPU and what remains is host work, measurable without a GPU.

What it runs: the training job's own step (`SFTStep.train_step` driven by `run_loop`, one rank, FSDP2, fused
AdamW, selective checkpointing (`--ac`), compiled blocks with `--compile`, the step guard, the stop flag), fed the
same pack every step. `--precision fp32` (default) has the CPU run our fused csrc kernels, one op per call like the
GPU's Triton ones; `bf16` adds FSDP2's casts but sends attention to SDPA's per-sample loop on the CPU. It reports

- the step time (min / median over `--steps` timed steps after warm-up), for the loop as the job runs it;
- with `--phases`: the wall time per step of each phase (forward, backward, clip, optimizer, ...);
- with `--count-reads`: the host reads of tensor values in one step (`item`, `tolist`, `bool()`, `float()`,
  `int()`, `cpu()`, `.to("cpu")`, `nonzero`, indexing by a bool mask and the other ops whose output size depends
  on the values) and blocking uploads (`torch.tensor(..., device=...)`, `.to(device)` of a host tensor), by call
  site (megatron_vlm/testing/host_reads.py). On CUDA each read of a device tensor waits for every kernel queued
  before it (a stream sync), and so does a blocking upload; on the CPU they are counted, not timed. Reads of the
  pack's own tensors (host tensors in a GPU job: the model gets copies, as `to_device` makes, which keep them as
  their host copies) and of what is computed from them alone are not counted;
- with `--against REV`: the same step with the code of git revision REV switched in (benchmarks/e2e/old_code.py),
  rounds of the two interleaved in this process: old / new step time and optimizer.step time, min and median (where
  REV's `build_optimizer` builds a base class of this tree's optimizer, e.g. torch's AdamW, its `step` runs on the
  same optimizer in REV's rounds);
- with `--profile`: torch.profiler's CPU-side table (top entries by self CPU time) and cProfile's top Python
  functions by cumulative time (all, then this project's), over `--profile-steps` steps.

What it cannot say: kernel times, overlap of host and device work, the cost of a sync on a GPU (the kernels queued
before it), or the CUDA caching allocator / launch costs (the CPU runs its kernels inline, with no launch queue).
Host cost only: host time saved here is saved on a GPU's host too (scaled by that CPU's speed), and shortens a GPU
step only where the GPU waited on the host. `--shape 3b` runs the same step and loop at the published widths on a
GPU (the job's step, where bench_train_step.py times a bare forward / backward / clip / optimizer step).

    python benchmarks/e2e/bench_host_overhead.py --phases --count-reads    # eager, full depth (36 + 32 blocks)
    python benchmarks/e2e/bench_host_overhead.py --compile --profile       # compiled blocks, CPU profile of 3 steps
    python benchmarks/e2e/bench_host_overhead.py --layers 8 --vision-depth 8   # a shallower model (faster compile)
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_rollout import positive_int  # noqa: E402
from bench_train_step import packed_batch  # noqa: E402

from megatron_vlm.host_copies import moved_to  # noqa: E402
from megatron_vlm.models import build_model, get_family  # noqa: E402
from megatron_vlm.parallel import build_mesh, init_distributed  # noqa: E402
from megatron_vlm.parallel.master_weights import MasterWeights  # noqa: E402
from megatron_vlm.testing.host_reads import HostReads  # noqa: E402
from megatron_vlm.training.context import RunContext  # noqa: E402
from megatron_vlm.training.loop import run_loop  # noqa: E402
from megatron_vlm.training.optim import OptimState, build_optimizer  # noqa: E402
from megatron_vlm.training.sft import SFTStep  # noqa: E402
from megatron_vlm.training.signals import StopFlag  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OPT_CFG = SimpleNamespace(lr=1e-4, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)


def tiny_wide_config(layers: int, vision_depth: int, hidden: int, vocab: int) -> dict:
    """Qwen2.5-VL-3B's structure (its depths, its vision tower's window / full-attention layout, tied embeddings)
    at tiny widths: 4 query / 2 key-value heads of hidden // 4, an MLP of 2 x hidden."""
    from transformers import Qwen2_5_VLConfig

    head_dim = hidden // 4
    half = head_dim // 2
    mrope = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    full = [i for i in (7, 15, 23, 31) if i < vision_depth] or [vision_depth - 1]
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope},
                         bos_token_id=None, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True),
        vision_config=dict(depth=vision_depth, hidden_size=hidden, intermediate_size=2 * hidden, num_heads=4,
                           out_hidden_size=hidden, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           window_size=112, fullatt_block_indexes=full, tokens_per_second=2),
        image_token_id=vocab - 4, video_token_id=vocab - 3, vision_start_token_id=vocab - 2,
        vision_end_token_id=vocab - 1, tie_word_embeddings=True,
    )
    d = cfg.to_dict()
    d["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
    return d


class SamePack:
    """The loader stand-in: the same packed micro-batch every time (the step's host work, not the data path's)."""

    def __init__(self, pack: dict):
        self.pack, self.epoch, self.packs_per_epoch = pack, 0, 10**9

    def __iter__(self):
        while True:
            yield dict(self.pack)

    def state_dict(self) -> dict:
        return {}

    def mark(self) -> None:
        """`SFTDataLoader.mark`: no position to remember (the same pack every time)."""

    def rewind(self) -> None:
        """`SFTDataLoader.rewind`: nothing to put back."""


class Rows:
    """The metrics logger stand-in: keeps the rows (the logged values are part of what must not change)."""

    def __init__(self):
        self.rows: list[tuple[str, int, dict]] = []

    def set_start(self, step: int) -> None:
        pass

    def log(self, split: str, step: int, metrics: dict) -> None:
        self.rows.append((split, step, dict(metrics)))

    def log_moe_table(self, step: int, table) -> None:
        pass


class NoCheckpoints:
    enabled = export_at_end = False

    def periodic_due(self, step: int) -> bool:
        return False


class DeviceCopyContext(RunContext):
    """`to_device` gives the model new tensors on the CPU too, as a GPU job's copy does: reads of the pack's own
    tensors (host tensors in a GPU job) are then told apart from reads of the model's inputs (device tensors)."""

    def to_device(self, batch: dict) -> dict:
        if self.env.device.type != "cpu":
            return super().to_device(batch)
        return moved_to(batch, self.env.device, copy=True)


def build(args, no_fsdp: bool = False) -> SimpleNamespace:
    """The model, its FSDP2 / checkpointing / compile setup as the job applies it, and an `SFTStep` over one pack;
    `no_fsdp`: as `parallel.fsdp = false` applies it instead of FSDP2."""
    env = init_distributed()
    torch.manual_seed(0)
    if args.shape == "3b":
        if env.device.type == "cpu":
            raise SystemExit("--shape 3b: the published Qwen2.5-VL-3B widths need a GPU (the CPU rows use --shape tiny)")
        from bench_rollout import qwen2_5_vl_3b_config

        cfg = qwen2_5_vl_3b_config()
    else:
        cfg = tiny_wide_config(args.layers, args.vision_depth, args.hidden, args.vocab)
    model = build_model(cfg, dtype=torch.float32, device=env.device)
    from megatron_vlm.training.lm_loss import TokenLogprobModel

    wrapper = TokenLogprobModel(model)
    parallel = SimpleNamespace(dp_replicate=1, dp_shard=-1, compile=args.compile, reshard_after_forward=True, tp=1,
                               cp=1, ep=1, pp=1)
    dims, mesh = build_mesh(parallel, env.world_size, env.device.type)
    param_dtype = torch.bfloat16 if args.precision == "bf16" else None
    if no_fsdp:  # parallel.fsdp = false: plain tensors; in bf16, bf16 weights with fp32 masters
        mesh = None
    get_family(model.hf_config.get("model_type")).parallelize(
        model, dims, parallel, mesh=mesh, param_dtype=param_dtype, root=wrapper,
        activation_checkpointing=False if args.ac == "off" else args.ac)
    masters = MasterWeights(wrapper, torch.bfloat16) if no_fsdp and param_dtype is not None else None
    optimizer = build_optimizer(wrapper, OPT_CFG, env.device.type)
    optim = OptimState(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))
    pack = packed_batch(cfg, args.samples, args.tokens, (1, args.grid, args.grid))
    pack.pop("lengths")
    pack["num_samples"] = torch.tensor(args.samples)
    pack["num_label_tokens"] = (pack["labels"] != -100).sum()
    train = SimpleNamespace(micro_batches_per_step=args.micro_batches, max_grad_norm=1.0,
                            max_consecutive_skipped_steps=5)
    run_dir = Path(tempfile.mkdtemp(prefix="host_overhead_"))
    ctx = DeviceCopyContext(cfg=SimpleNamespace(train=train), env=env, run_dir=run_dir, stop=StopFlag())
    trainable = [p if masters is None else masters.params_or(p) for p in wrapper.parameters() if p.requires_grad]
    bundle = SimpleNamespace(model=model, wrapper=wrapper, dims=dims, trainable_params=trainable,
                             moe_balancer=None, pipeline=None, num_params=sum(p.numel() for p in model.parameters()))
    metrics = Rows()
    sft = SFTStep(ctx, bundle, optim, metrics, SamePack(pack), total_steps=10**9)
    return SimpleNamespace(ctx=ctx, sft=sft, metrics=metrics, model=model, pack=pack, env=env)


def run_steps(b: SimpleNamespace, n: int, log_every: int, hook=None) -> list[float]:
    """`n` timed steps through `run_loop` (the job's loop: logging cadence, stop flag, per-step checks): the wall
    time from one step's start to the next's. The loop runs one step more, untimed: its last step always logs.
    `hook(k)`: called before step k (1-based) starts."""
    stamps: list[float] = []

    def before(k: int) -> None:
        stamps.append(time.perf_counter())
        if hook is not None:
            hook(k)

    run_loop(b.ctx, b.sft, total_steps=n + 1, checkpointer=NoCheckpoints(), metrics=b.metrics, log_every=log_every,
             before_step=before)
    return [t1 - t0 for t0, t1 in zip(stamps, stamps[1:])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=("tiny", "3b"), default="tiny",
                    help="tiny: the 3B's structure at --hidden (the CPU rows); 3b: the published widths (GPU only: "
                         "the job's own step and loop at the bench_train_step shape, e.g. --tokens 16384 --samples 8 "
                         "--grid 32 --precision bf16 --compile)")
    ap.add_argument("--layers", type=positive_int, default=36, help="decoder layers (the 3B: 36)")
    ap.add_argument("--vision-depth", type=positive_int, default=32, help="vision blocks (the 3B: 32)")
    ap.add_argument("--hidden", type=positive_int, default=64, help="hidden size of both towers")
    ap.add_argument("--vocab", type=positive_int, default=2048)
    ap.add_argument("--tokens", type=positive_int, default=128, help="tokens of the pack")
    ap.add_argument("--samples", type=positive_int, default=2, help="samples (one image each) in the pack")
    ap.add_argument("--grid", type=int, default=8, help="image patch grid side (8: 64 patches, 16 image tokens)")
    ap.add_argument("--micro-batches", type=positive_int, default=1, help="train.micro_batches_per_step")
    ap.add_argument("--ac", choices=("full", "selective", "off"), default="selective")
    ap.add_argument("--compile", action="store_true", help="torch.compile every block (parallel.compile)")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="fp32",
                    help="fp32 (default): the CPU runs our fused csrc kernels, one op per call as the GPU's Triton "
                         "ones; bf16: FSDP2's bf16 casts as on the GPU, but attention falls back to torch SDPA's "
                         "per-sample loop on the CPU (Python work a GPU step does not have)")
    ap.add_argument("--steps", type=positive_int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=positive_int, default=3, help="untimed steps first (compile happens here)")
    ap.add_argument("--log-every", type=positive_int, default=10**9,
                    help="train.log_every of the timed steps (default: no step logs)")
    ap.add_argument("--count-reads", action="store_true", help="host reads of one step, by call site")
    ap.add_argument("--phases", action="store_true", help="wall time per phase of the step (forward, backward, clip, "
                    "guard, optimizer, ...), over --steps steps")
    ap.add_argument("--profile", action="store_true", help="torch.profiler + cProfile tables over --profile-steps steps")
    ap.add_argument("--profile-steps", type=positive_int, default=3)
    ap.add_argument("--against", type=str, default=None, metavar="REV",
                    help="also time the code of git revision REV in this process (the functions of megatron_vlm/ "
                         "changed since REV switched in: benchmarks/e2e/old_code.py), --rounds rounds of --steps "
                         "steps each, the two interleaved (step and optimizer.step times); --count-reads then counts "
                         "REV's reads too")
    ap.add_argument("--rounds", type=positive_int, default=6, help="interleaved rounds of --against")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (the machine is shared)")
    ap.add_argument("--no-fsdp", action="store_true", help="parallel.fsdp = false (bf16: bf16 weights, fp32 masters)")
    ap.add_argument("--against-fsdp", action="store_true",
                    help="also build the --no-fsdp step (or, with --no-fsdp, the FSDP2 one) in this process and time "
                         "the two in interleaved --rounds of --steps steps")
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    b = build(args, no_fsdp=args.no_fsdp)
    meta = {"fsdp": not args.no_fsdp, "shape": args.shape, "device": str(b.env.device), "layers": args.layers, "vision_depth": args.vision_depth, "hidden": args.hidden, "tokens": args.tokens,
            "samples": args.samples, "micro_batches": args.micro_batches, "ac": args.ac, "compile": args.compile,
            "precision": args.precision, "log_every": args.log_every, "threads": args.threads,
            "torch": torch.__version__, "build_s": round(time.perf_counter() - t0, 2)}
    print(json.dumps(meta), flush=True)
    t0 = time.perf_counter()
    run_steps(b, args.warmup, args.log_every)
    meta["warmup_s"] = round(time.perf_counter() - t0, 2)
    times = run_steps(b, args.steps, args.log_every)
    out: dict = {"meta": meta, "step_ms_min": 1e3 * min(times), "step_ms_median": 1e3 * statistics.median(times)}
    print(f"step: min {out['step_ms_min']:.1f} ms, median {out['step_ms_median']:.1f} ms over {len(times)} steps "
          f"(warm-up {meta['warmup_s']} s)", flush=True)
    if args.count_reads:
        out["host_reads"] = count_reads(b)
    if args.against:
        out["against"] = against(b, args)
    if args.against_fsdp:
        out["against_fsdp"] = against_fsdp(b, args)
    if args.phases:
        out["phases"] = phases(b, args)
    if args.profile:
        out["profile"] = profile(b, args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


def against_fsdp(b: SimpleNamespace, args) -> dict:
    """Step times of `b` and of the same step built the other way (FSDP2 / `parallel.fsdp = false`), in interleaved
    rounds, the order alternating; the ratio FSDP2 / no FSDP2 of their min and median."""
    other = build(args, no_fsdp=not args.no_fsdp)
    run_steps(other, args.warmup, args.log_every)
    mine, theirs = ("plain", "fsdp") if args.no_fsdp else ("fsdp", "plain")
    steps = {mine: b, theirs: other}
    times: dict[str, list[float]] = {"fsdp": [], "plain": []}
    for r in range(args.rounds):
        for which in (("fsdp", "plain") if r % 2 == 0 else ("plain", "fsdp")):
            times[which] += run_steps(steps[which], args.steps, args.log_every)
    res: dict = {k: {"step_ms_min": 1e3 * min(v), "step_ms_median": 1e3 * statistics.median(v), "steps": len(v)}
                 for k, v in times.items()}
    for k in ("min", "median"):
        res[f"fsdp_over_plain_{k}"] = res["fsdp"][f"step_ms_{k}"] / res["plain"][f"step_ms_{k}"]
    print(f"FSDP2: min {res['fsdp']['step_ms_min']:.1f} ms, median {res['fsdp']['step_ms_median']:.1f} ms; "
          f"parallel.fsdp = false: min {res['plain']['step_ms_min']:.1f} ms, median {res['plain']['step_ms_median']:.1f} "
          f"ms; FSDP2 / no FSDP2 {res['fsdp_over_plain_min']:.3f} (min), {res['fsdp_over_plain_median']:.3f} (median), "
          f"{args.rounds} rounds of {args.steps} steps", flush=True)
    return res


def against(b: SimpleNamespace, args) -> dict:
    """Step times of this tree's code and of `args.against`'s, in interleaved rounds (the order alternating), the
    optimizer.step phase of each (its own min / median), and, with --count-reads, the old code's host reads."""
    from old_code import OldCode

    old = OldCode(args.against)
    print(f"--against {args.against}: {len(old.changed)} bindings switched", flush=True)
    opt = b.sft.optim.optimizer
    original = opt.step
    opt_times: dict[str, list[float]] = {}
    new_step, old_step = _optimizer_steps(b, old, opt_times)

    def run(which: str, n: int) -> list[float]:
        opt.step = new_step if which == "new" else old_step
        opt_times["now"] = opt_times.setdefault(which, [])
        try:
            if which == "new":
                return run_steps(b, n, args.log_every)
            with old:
                return run_steps(b, n, args.log_every)
        finally:
            opt.step = original

    run(args.against, args.warmup)
    opt_times[args.against].clear()
    times: dict[str, list[float]] = {"new": [], args.against: []}
    for r in range(args.rounds):
        for which in (("new", args.against) if r % 2 == 0 else (args.against, "new")):
            times[which] += run(which, args.steps)
    res: dict = {k: {"step_ms_min": 1e3 * min(v), "step_ms_median": 1e3 * statistics.median(v), "steps": len(v),
                     "optimizer_ms_min": 1e3 * min(opt_times[k]),
                     "optimizer_ms_median": 1e3 * statistics.median(opt_times[k])}
                 for k, v in times.items()}
    for k in ("min", "median"):
        res[f"old_over_new_{k}"] = res[args.against][f"step_ms_{k}"] / res["new"][f"step_ms_{k}"]
    print(f"this tree: min {res['new']['step_ms_min']:.1f} ms, median {res['new']['step_ms_median']:.1f} ms; "
          f"{args.against}: min {res[args.against]['step_ms_min']:.1f} ms, median "
          f"{res[args.against]['step_ms_median']:.1f} ms; old / new {res['old_over_new_min']:.3f} (min), "
          f"{res['old_over_new_median']:.3f} (median), {args.rounds} rounds of {args.steps} steps", flush=True)
    print(f"optimizer.step: this tree min {res['new']['optimizer_ms_min']:.2f} ms, median "
          f"{res['new']['optimizer_ms_median']:.2f} ms; {args.against}: min "
          f"{res[args.against]['optimizer_ms_min']:.2f} ms, median {res[args.against]['optimizer_ms_median']:.2f} ms",
          flush=True)
    if args.count_reads:
        print(f"{args.against}'s code:")
        opt_times["now"] = []
        opt.step = old_step
        try:
            with old:
                res["host_reads"] = count_reads(b)
        finally:
            opt.step = original
    return res


def _optimizer_steps(b: SimpleNamespace, old, times: dict) -> tuple:
    """The optimizer's `step` as this tree runs it and as the old code would, each timing its calls into
    `times["now"]`. The optimizer was built once, by this tree's `build_optimizer`: where the old one builds a class
    this optimizer derives from (torch's AdamW, before a subclass that overrides its step), the old rounds run that
    class's `step` on this optimizer (same parameters and state); other classes cannot be swapped (both rounds then
    run this tree's)."""
    import megatron_vlm.training.optim as optim_mod

    opt, wrapper = b.sft.optim.optimizer, b.sft.bundle.wrapper
    current = opt.step  # the scheduler's wrapper of the class's step
    with old:
        old_cls = type(optim_mod.build_optimizer(wrapper, OPT_CFG, b.env.device.type))
    if old_cls is type(opt) or not isinstance(opt, old_cls):
        if old_cls is not type(opt):
            print(f"the old code builds {old_cls.__name__}, not a base of {type(opt).__name__}: both rounds run "
                  f"this tree's optimizer", flush=True)
        old_fn = current
    else:
        print(f"old rounds: {old_cls.__module__}.{old_cls.__qualname__}.step on this {type(opt).__name__}", flush=True)

        def old_fn(*a, **k):
            opt._opt_called = True  # what the scheduler's wrapper records
            return old_cls.step(opt, *a, **k)

    def timed(fn):
        def step(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times["now"].append(time.perf_counter() - t0)

        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        return step

    return timed(current), timed(old_fn)


def count_reads(b: SimpleNamespace) -> dict:
    """Host reads of a step that logs nothing and of one that logs its row, by kind and call site."""
    mode = HostReads(host=[v for v in b.pack.values() if torch.is_tensor(v)])
    per_step: dict[int, collections.Counter] = {}

    def hook(k: int) -> None:
        mode.sites = per_step.setdefault(k, collections.Counter())

    with mode:
        run_steps(b, 1, 10**9, hook)  # step 1 logs nothing, step 2 (the loop's last) logs
    out = {}
    for k, what in ((1, "step without a log row"), (2, "step that logs its row")):
        sites = per_step[k]
        kinds: collections.Counter = collections.Counter()
        for (kind, _), n in sites.items():
            kinds[kind] += n
        total = sum(sites.values())
        print(f"host reads, {what}: {total} ({dict(kinds)})")
        for (kind, site), n in sites.most_common():
            print(f"  {n:4d} {kind:7s} {site}")
        out[what] = {"total": total, "by_kind": dict(kinds),
                     "sites": [{"n": n, "kind": kd, "site": st} for (kd, st), n in sites.most_common()]}
    return out


class _Timed:
    """A callable's wall time summed into `acc[name]` (a proxy: other attributes go to the wrapped object)."""

    def __init__(self, fn, name: str, acc: dict):
        self._fn, self._name, self._acc = fn, name, acc

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._fn(*args, **kwargs)
        finally:
            self._acc[self._name] += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._fn, name)


def phases(b: SimpleNamespace, args) -> dict:
    """Wall time per step of each phase of `SFTStep.train_step` and the loop around it, measured by wrapping the
    callables the step calls (what is left: the loader fetch, the loss arithmetic, the metrics, the loop)."""
    import megatron_vlm.training.sft as sft_mod

    acc: dict = collections.defaultdict(float)
    sft, bundle, opt = b.sft, b.sft.bundle, b.sft.optim.optimizer
    saved = {"wrapper": bundle.wrapper, "clip": sft_mod.clip_grad_norm_, "reduce": sft_mod.all_reduce_sum,
             "allow": sft.guard.allow, "step": opt.step, "zero": opt.zero_grad, "stop": b.ctx.stop.should_stop,
             "sched": sft.optim.scheduler.step, "backward": torch.Tensor.backward}
    bundle.wrapper = _Timed(saved["wrapper"], "forward (TokenLogprobModel, incl. FSDP root hooks)", acc)
    sft_mod.clip_grad_norm_ = _Timed(saved["clip"], "clip_grad_norm_", acc)
    sft_mod.all_reduce_sum = _Timed(saved["reduce"], "all_reduce_sum (counts, loss)", acc)
    sft.guard.allow = _Timed(saved["allow"], "step guard", acc)
    opt.step = _Timed(saved["step"], "optimizer.step", acc)
    opt.zero_grad = _Timed(saved["zero"], "zero_grad", acc)
    sft.optim.scheduler.step = _Timed(saved["sched"], "scheduler.step", acc)
    b.ctx.stop.should_stop = _Timed(saved["stop"], "stop flag (loop)", acc)
    backward = _Timed(saved["backward"], "backward", acc)
    torch.Tensor.backward = lambda self, *a, **k: backward(self, *a, **k)
    try:
        times = run_steps(b, args.steps, args.log_every)
    finally:
        bundle.wrapper, sft_mod.clip_grad_norm_, sft_mod.all_reduce_sum = saved["wrapper"], saved["clip"], saved["reduce"]
        torch.Tensor.backward = saved["backward"]
        for obj, attr in ((sft.guard, "allow"), (opt, "step"), (opt, "zero_grad"), (sft.optim.scheduler, "step"),
                          (b.ctx.stop, "should_stop")):
            delattr(obj, attr)
    n = args.steps + 1  # the loop's last step (untimed in `times`) ran its phases too
    step_ms = 1e3 * sum(times) / len(times)
    rows = {k: 1e3 * v / n for k, v in sorted(acc.items(), key=lambda kv: -kv[1])}
    rows["rest (fetch, loss arithmetic, metrics, loop)"] = step_ms - sum(rows.values())
    print(f"phases, ms per step (mean step {step_ms:.1f} ms):")
    for k, v in rows.items():
        print(f"  {v:8.1f} ms {v / step_ms:6.1%}  {k}")
    return {"step_ms_mean": step_ms, "ms_per_step": rows}


def profile(b: SimpleNamespace, args) -> dict:
    """torch.profiler's CPU table (self CPU time) and cProfile's cumulative Python time, over a few steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    n = args.profile_steps
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        run_steps(b, n - 1, args.log_every)  # n steps, the last of which logs
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total_self = sum(e.self_cpu_time_total for e in events)
    ops = [{"name": e.key, "calls_per_step": e.count / n, "self_ms_per_step": e.self_cpu_time_total / 1e3 / n,
            "share": e.self_cpu_time_total / total_self} for e in events[:30]]
    print(f"torch.profiler, self CPU per step (total {total_self / 1e3 / n:.1f} ms):")
    for r in ops[:25]:
        print(f"  {r['self_ms_per_step']:8.2f} ms {r['share']:6.1%} {r['calls_per_step']:8.0f}x {r['name'][:90]}")
    pr = cProfile.Profile()
    pr.enable()
    times = run_steps(b, n - 1, args.log_every)
    pr.disable()
    s = io.StringIO()
    stats = pstats.Stats(pr, stream=s)
    stats.sort_stats("cumulative").print_stats(40)
    ours = io.StringIO()
    pstats.Stats(pr, stream=ours).sort_stats("cumulative").print_stats(r"megatron_vlm/(?!kernels/)", 40)
    print(f"cProfile ({n} steps, {1e3 * sum(times) / max(len(times), 1):.0f} ms per timed step under it), top cumulative:")
    print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:12000])
    print("cProfile, this project's functions (kernels left out), top cumulative:")
    print("\n".join(line for line in ours.getvalue().splitlines() if line.strip())[:12000])
    return {"ops": ops, "cprofile_top": s.getvalue()[:20000], "cprofile_ours": ours.getvalue()[:20000]}


if __name__ == "__main__":
    main()
