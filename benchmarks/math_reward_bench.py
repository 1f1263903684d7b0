"""Agreement and latency of the `math` reward on the hand-written answer corpus.

Why: the reward's verdicts are what GRPO optimises, so this script prints how often they agree with
the corpus labels (overall and per answer kind), how long one verification takes (p50 / p99 over
all cases, in process, on the CPU) and how long the pathological inputs take. With
`--math-verify` it runs Hugging Face math-verify (LaTeX extraction only, the configuration that
keeps code-evaluating parsers away from model output) on the same corpus for comparison — the
measurement behind the choice of parser documented in megatron_vlm/rl/rewards/README.md.

    python benchmarks/math_reward_bench.py [--math-verify [--skip-ours]] [--repeat 3]
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import resource
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "unit" / "rl"))

from math_reward_corpus import CASES  # noqa: E402
from math_reward_corpus_forms import FORM_KINDS  # noqa: E402

PATHOLOGICAL = {
    "(a+b+c+d)^1000": (r"\boxed{(a+b+c+d)^{1000}}", r"(a+b+c+d)^{1000} + 1"),
    "sin^999+cos^998": (r"\boxed{\sin(x)^{999}+\cos(x)^{998}}", "1"),
    "20000 unclosed boxed": ("\\boxed{" * 20000, "1"),
    "2^{10^{10}}": (r"\boxed{2^{10^{10}}}", "1"),
    "20000 joined boxes": ("\\boxed{1}, " * 20000, "1"),
    "16 vs 16 symbolic items": (
        "\\boxed{" + ", ".join(f"x^{{{k % 20 + 2}}} + {k}" for k in range(16)) + "}",
        ", ".join(f"x^{{{k % 20 + 2}}} + {k + 1}" for k in range(16)),
    ),
    "ratio of 200 parts": ("\\boxed{" + ":".join(["2"] * 200) + "}", "1"),
}


def ours():
    from megatron_vlm.rl.rewards.verifiers import math_reward

    return lambda completion, gold: math_reward(completion, gold) == 1.0


def math_verify_latex_only():
    from math_verify import LatexExtractionConfig, parse, verify

    cfg = [LatexExtractionConfig()]

    def fn(completion, gold):
        g = gold if "$" in gold or "\\boxed" in gold else f"${gold}$"
        return bool(verify(parse(g, extraction_config=cfg), parse(completion, extraction_config=cfg)))

    return fn


def run(name, fn, repeat):
    times, agree = [], collections.Counter()
    times_in_order = []
    slowest = []
    total = collections.Counter()
    wrong = []
    false_pos = 0
    for kind, completion, gold, label in CASES:
        best = None
        for _ in range(repeat):
            t = time.perf_counter()
            got = fn(completion, gold)
            dt = time.perf_counter() - t
            best = dt if best is None else min(best, dt)
        times.append(best)
        times_in_order.append(best)
        slowest.append((best, completion[:60], gold[:30]))
        total[kind] += 1
        if got == label:
            agree[kind] += 1
        else:
            wrong.append((kind, completion, gold, label))
            false_pos += (got and not label)
    n = len(CASES)
    ok = sum(agree.values())
    times.sort()
    p = lambda q: times[min(len(times) - 1, int(q * len(times)))] * 1e3  # noqa: E731
    print(f"== {name}: agreement {ok}/{n} = {100 * ok / n:.1f} %, 'equal' on a negative: {false_pos}")
    forms = [(k, c, g, lab) for k, c, g, lab in CASES if k in FORM_KINDS]
    forms_ok = sum(agree[k] for k in FORM_KINDS)
    forms_fp = sum(1 for k, c, g, lab in wrong if k in FORM_KINDS and not lab)
    print(f"   forms of real completions ({', '.join(FORM_KINDS)}): {forms_ok}/{len(forms)} = "
          f"{100 * forms_ok / len(forms):.1f} %, 'equal' on a negative: {forms_fp}; "
          f"the other kinds: {ok - forms_ok}/{n - len(forms)}")
    for kind in sorted(total):
        print(f"   {kind:14s} {agree[kind]:3d}/{total[kind]:3d} = {100 * agree[kind] / total[kind]:5.1f} %")
    print(f"   time per verification: p50 {p(0.5):.2f} ms, p99 {p(0.99):.2f} ms, max {times[-1] * 1e3:.1f} ms, "
          f"mean {statistics.mean(times) * 1e3:.2f} ms")
    old = sorted(t for t, (k, *_) in zip(times_in_order, CASES) if k not in FORM_KINDS)
    print(f"   p99 on the other kinds alone: {old[min(len(old) - 1, int(0.99 * len(old)))] * 1e3:.2f} ms")
    for dt, completion, gold in sorted(slowest, reverse=True)[:3]:
        print(f"   slowest: {dt * 1e3:7.1f} ms  {completion!r} vs {gold!r}")
    for kind, completion, gold, label in wrong:
        print(f"   disagree [{kind}] label={label}: {completion!r} vs {gold!r}")
    for pname, (completion, gold) in PATHOLOGICAL.items():
        t = time.perf_counter()
        try:
            fn(completion, gold)
            status = "ok"
        except Exception as e:  # noqa: BLE001
            status = type(e).__name__
        print(f"   pathological {pname:22s} {1e3 * (time.perf_counter() - t):8.1f} ms {status}")
    print(f"   max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--math-verify", action="store_true", help="also run math-verify (LaTeX extraction only)")
    ap.add_argument("--skip-ours", action="store_true", help="run only math-verify")
    ap.add_argument("--repeat", type=int, default=3, help="timing: best of N runs per case")
    args = ap.parse_args()
    if not args.skip_ours:
        t = time.perf_counter()
        fn = ours()
        print(f"import of the math reward: {time.perf_counter() - t:.2f} s")
        run("megatron_vlm math reward", fn, args.repeat)
    if args.math_verify:
        try:
            import math_verify  # noqa: F401
        except ImportError:
            print("skipped: math-verify: not installed (pip install math-verify; the dev extra has it)")
            return
        t = time.perf_counter()
        fn = math_verify_latex_only()
        print(f"import of math-verify: {time.perf_counter() - t:.2f} s")
        run("math-verify 0.9 (LatexExtractionConfig only)", fn, 1)


if __name__ == "__main__":
    main()
