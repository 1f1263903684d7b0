"""Start-up cost of planning the packs at a real dataset's scale (CPU): records/s of the length pass.

Before the first step every loader computes each record's token length (`data.lengths.compute_lengths`:
the chat template rendered, the text tokenised, each image's header read) to plan its packs. This
benchmark builds a synthetic messages-JSONL set of `--records` records (small PNGs, one per record,
drawn from `--images` files; a tenth text-only; a few bad lines) with the tiny Qwen2.5-VL processor,
and times, interleaved in one process (min and median of `--repeats`):

  * `compute_lengths` serial over records held in memory (the code every rank ran before: all records on
    one core), serial over the offset-indexed source (`sources.MessagesRecords`, a record parsed per get),
    the same pass split over `--world` ranks (what one rank computes: 1 / world of the records) and over
    `--workers` worker processes (`data.num_workers`);
  * the SFT loader (`build_sft_dataloader`) and the DPO loader (`build_preference_dataloader`, pairs
    from the same records) start-up, serial (`num_workers = 0`) and with `--workers` workers, and the
    GRPO prompt filter (`drop_unusable_prompts`, serial: GRPO refuses `data.num_workers`);
  * the pack planner on `--plan-records` lengths (time and peak memory of one epoch's plan), and the
    memory the opened messages-JSONL split holds per record.

    python benchmarks/e2e/bench_data_planning.py --records 4000 --workers 2 --world 8
    python benchmarks/e2e/bench_data_planning.py --profile --records 3000   # cProfile of the serial pass
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_vlm.data.config import DataConfig  # noqa: E402
from megatron_vlm.data.lengths import compute_lengths  # noqa: E402
from megatron_vlm.data.loader import build_processor, build_sft_dataloader  # noqa: E402
from megatron_vlm.data.messages import read_messages_jsonl  # noqa: E402
from megatron_vlm.data.plan import PackPlanner  # noqa: E402
from megatron_vlm.data.preference_loader import build_preference_dataloader  # noqa: E402
from megatron_vlm.data.sources import ListRecords, open_split  # noqa: E402
from megatron_vlm.testing.tiny_processor import build_tiny_qwen2_5_vl_processor  # noqa: E402

_WORDS = ("what", "color", "is", "the", "shape", "in", "image", "count", "objects", "left", "right", "answer")


def write_dataset(folder: Path, n: int, n_images: int, seed: int = 0) -> Path:
    """messages JSONL with `n` records (9 in 10 with one image, 1 in 500 a broken line or a missing image)."""
    rng = np.random.default_rng(seed)
    (folder / "img").mkdir(parents=True, exist_ok=True)
    for k in range(n_images):
        w, h = 56 + 28 * (k % 3), 56 + 28 * (k % 2)
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / "img" / f"{k}.png")
    lines = []
    for i in range(n):
        words = " ".join(rng.choice(_WORDS, size=int(rng.integers(3, 30))))
        answer = " ".join(rng.choice(_WORDS, size=int(rng.integers(1, 20))))
        if i % 500 == 7:
            lines.append("{not json")
            continue
        content: list = [{"type": "text", "text": f"item {i}: {words}"}]
        if i % 10:
            name = f"img/{i % n_images}.png" if i % 500 != 11 else "img/missing.png"
            content.insert(0, {"type": "image", "image": name})
        lines.append(json.dumps({"messages": [{"role": "user", "content": content},
                                              {"role": "assistant", "content": answer}]}))
    path = folder / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_pairs(folder: Path, n: int, n_images: int, seed: int = 1) -> Path:
    """Preference pairs (prompt with an image, chosen, rejected) as JSONL."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        q = " ".join(rng.choice(_WORDS, size=int(rng.integers(3, 30))))
        prompt = [{"role": "user", "content": [{"type": "image", "image": f"img/{i % n_images}.png"},
                                               {"type": "text", "text": f"pair {i}: {q}"}]}]
        lines.append(json.dumps({"prompt": prompt,
                                 "chosen": [{"role": "assistant", "content": " ".join(rng.choice(_WORDS, 5))}],
                                 "rejected": [{"role": "assistant", "content": " ".join(rng.choice(_WORDS, 9))}]}))
    path = folder / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def interleaved(cases: dict, repeats: int) -> dict[str, list[float]]:
    """Each case once per round, rounds repeated: machine load drifts hit every case alike."""
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return times


def summary(times: dict[str, list[float]], n: int, base: str) -> list[dict]:
    rows = []
    bmin, bmed = min(times[base]), statistics.median(times[base])
    for name, ts in times.items():
        rows.append({"case": name, "min_s": round(min(ts), 3), "median_s": round(statistics.median(ts), 3),
                     "records_per_s_min": round(n / min(ts)), "speedup_min": round(bmin / min(ts), 2),
                     "speedup_median": round(bmed / statistics.median(ts), 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=3000)
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--world", type=int, default=8, help="ranks the length pass is split over (one rank timed)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--plan-records", type=int, default=1_000_000)
    ap.add_argument("--profile", action="store_true", help="cProfile the serial length pass and stop")
    ap.add_argument("--skip-loaders", action="store_true")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench_data_planning_"))
    path = write_dataset(tmp / "data", args.records, args.images)
    proc_dir = build_tiny_qwen2_5_vl_processor(tmp / "proc")
    cfg = DataConfig(type="messages_jsonl", train_path=str(path), max_tokens_per_pack=1024, num_workers=0)
    proc = build_processor(cfg, proc_dir)
    t = time.perf_counter()
    source = open_split(cfg, "train")
    read_s = time.perf_counter() - t
    n = len(source)
    print(json.dumps({"records": n, "read_jsonl_s": round(read_s, 3)}))

    def serial():
        return compute_lengths(source, proc, max_frames=cfg.max_frames)

    if args.profile:
        pr = cProfile.Profile()
        pr.enable()
        serial()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(40)
        print(s.getvalue())
        return
    reference = serial()
    # the code before: records held in memory (ListRecords over the eager reader), all of them on one core
    held = ListRecords(str(path), read_messages_jsonl(path), [path])
    cases = {"before: serial, records in memory": lambda: compute_lengths(held, proc, max_frames=cfg.max_frames),
             "serial": serial}
    try:
        from megatron_vlm.data.lengths import compute_length_slice  # the split pass (new)
    except ImportError:
        compute_length_slice = None
    if compute_length_slice is not None:
        cases[f"one rank of {args.world}"] = lambda: compute_length_slice(
            source, proc, range(0, n, args.world), max_frames=cfg.max_frames)
        if args.workers:
            def pooled():
                got = compute_lengths(source, proc, max_frames=cfg.max_frames, num_workers=args.workers)
                assert np.array_equal(got, reference)
            cases[f"{args.workers} workers"] = pooled
    times = interleaved(cases, args.repeats)
    print(json.dumps({"length_pass": summary(times, n, "before: serial, records in memory")}, indent=1))

    if not args.skip_loaders:
        from types import SimpleNamespace

        from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
        from megatron_vlm.rl.prompts.lengths import drop_unusable_prompts
        from megatron_vlm.rl.prompts.sets import PromptSets

        pairs = write_pairs(tmp / "data", max(1, n // 2), args.images)
        prompts = load_prompt_dataset(path, schema="messages")
        rl_cfg = SimpleNamespace(rollout=SimpleNamespace(max_new_tokens=128), eval=SimpleNamespace(max_new_tokens=0))
        loader_cases = {}
        for w in sorted({0, args.workers}):
            c = DataConfig(type="messages_jsonl", train_path=str(path), max_tokens_per_pack=1024, num_workers=w)
            loader_cases[f"sft num_workers={w}"] = (lambda c=c: build_sft_dataloader(c, proc, seed=0, dp_rank=0,
                                                                                    dp_size=1))
            dc = DataConfig(type="messages_jsonl", train_path=str(pairs), max_tokens_per_pack=1024, num_workers=w)
            loader_cases[f"dpo num_workers={w}"] = (lambda c=dc: build_preference_dataloader(c, proc, seed=0, dp_rank=0,
                                                                                            dp_size=1))
        loader_cases["grpo prompts"] = lambda: drop_unusable_prompts(PromptSets(prompts, None), proc, cfg, rl_cfg)
        times = interleaved(loader_cases, args.repeats)
        for kind, count in (("sft", n), ("dpo", 2 * max(1, n // 2))):
            rows = {k: v for k, v in times.items() if k.startswith(kind + " ")}
            print(json.dumps({f"{kind}_startup": summary(rows, count, f"{kind} num_workers=0")}, indent=1))
        # GRPO refuses data.num_workers: its prompt filter always runs serially in the training process
        print(json.dumps({"grpo_prompt_filter_startup": summary({"grpo prompts": times["grpo prompts"]}, n,
                                                                "grpo prompts")}, indent=1))

    lengths = np.random.default_rng(0).integers(20, 900, args.plan_records)
    t = time.perf_counter()
    packs = PackPlanner(lengths, 4096, seed=0, shuffle=True).num_packs(0)
    plan_s = time.perf_counter() - t
    tracemalloc.start()  # separately: tracing slows every allocation
    PackPlanner(lengths, 4096, seed=0, shuffle=True).num_packs(0)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    tracemalloc.start()
    t = time.perf_counter()
    held = open_split(cfg, "train")
    read_held, read_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(json.dumps({"planner": {"lengths": args.plan_records, "packs": packs, "plan_s": round(plan_s, 3),
                                  "peak_mib": round(peak / 2**20, 1)},
                      "jsonl_records_in_memory": {"bytes_per_record": round(read_held / len(held)),
                                                  "peak_bytes_per_record": round(read_peak / len(held)),
                                                  "file_bytes_per_record": round(path.stat().st_size / len(held))}}))

if __name__ == "__main__":
    main()
