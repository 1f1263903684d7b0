"""Benchmark evaluation of a model folder (`[train] mode = "eval"`, launch/evaluate.py): greedy
accuracy and sampled Avg@k / pass@k per benchmark, scored with the training verifiers.

Per `[[eval.benchmarks]]` table: the rows (eval/benchmarks.py) go through the data pipeline's eval
loader — split over all ranks, the same number of left-padded batches on each — and every batch is
one call of the rollout engine (`answer_accuracy.generate_answers`, the generation half of the SFT
run's answer accuracy, so the same model on the same held-out file scores the same here). A prompt
longer than `data.max_tokens_per_pack - eval.max_new_tokens`, an image that cannot be read or a row
without question / answer is a bad record: skipped, counted and listed in the results. A skipped row is
one skip of its benchmark however many decoding passes (greedy, sampled) met it (`num_skips`);
`skipped_by_mode` says how many rows each pass could not score.

Scoring (each rank its own rows, then gathered): `short_answer` rows compare the first word
(eval/answers.py, the training-time rule); `math` / `choice` / `exact_match` rows go to the GRPO
reward verifiers (RewardManager: worker processes with time limits; a verifier that times out or
fails scores 0 and is counted: `verifier_failures` of the benchmark's results, timeouts and errors, each
data-parallel shard once). With `eval.reasoning_end` every verifier reads only the text after the reasoning's
last closing delimiter, as the training rewards with `reasoning_end`; a completion without it scores 0
(`verifier_failures.reasoning_unclosed`). Greedy: one completion at temperature 0, accuracy = Avg@1. Sampled
(`eval.samples` = k > 0): k completions per prompt, Avg@k = mean correctness over all samples,
pass@k = share of prompts with at least one correct sample (eval/accuracy.py). Rows whose metadata
has a `question_type` (the synthetic sets, MathVista, MMMU) also get the greedy accuracy per type. Sampling
is seeded by (train.seed, benchmark, data-parallel rank): the tp / cp ranks of a group sample alike.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from contextlib import contextmanager
from typing import Optional

from megatron_vlm.config.eval_section import MIN_PROMPT_TOKENS, BenchmarkConfig, EvalConfig
from megatron_vlm.data.bad_records import BadRecordLog, keep_planning_records, merge_by_shard
from megatron_vlm.data.loader import build_eval_dataloader
from megatron_vlm.eval.accuracy import avg_at_k, pass_at_k
from megatron_vlm.eval.answer_accuracy import GeneratedAnswers, generate_answers
from megatron_vlm.eval.answers import answers_match
from megatron_vlm.eval.benchmarks import open_benchmark
from megatron_vlm.inference.engine import SamplingParams
from megatron_vlm.inference.generators import sampling_generator
from megatron_vlm.parallel.collectives import all_gather_objects
from megatron_vlm.rl.rewards.config import ChoiceRewardConfig, ExactMatchRewardConfig, MathRewardConfig
from megatron_vlm.rl.rewards.manager import RewardManager, after_reasoning
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.model_bundle import ModelBundle

__all__ = ["VerifierScorer", "evaluate_benchmark", "merge_verifier_failures"]

log = logging.getLogger("megatron_vlm")

_SAMPLING_SALT = 29


class VerifierScorer:
    """Scores completions with the verifier named in each row's metadata; the reward worker
    processes start at the first row that needs one. `close()` them at the end."""

    def __init__(self, ecfg: EvalConfig):
        self.ecfg = ecfg
        self.manager: Optional[RewardManager] = None
        self.failures = {"timeouts": 0, "errors": 0, "reasoning_unclosed": 0}
        """Verifier calls that timed out / raised so far, completions without `eval.reasoning_end` (each scored 0)."""

    def _manager(self) -> RewardManager:
        if self.manager is None:
            end = self.ecfg.reasoning_end  # cut by the manager, as in training
            rewards = [MathRewardConfig(reasoning_end=end), ChoiceRewardConfig(reasoning_end=end),
                       ExactMatchRewardConfig(reasoning_end=end)]
            self.manager = RewardManager(rewards, timeout_s=self.ecfg.reward_timeout_s, num_workers=self.ecfg.reward_workers)
        return self.manager

    def score(self, rows: list[GeneratedAnswers]) -> list[list[float]]:
        """Score of every completion of every row, [row][sample]."""
        out: list[list[float]] = [[] for _ in rows]
        by_verifier: dict[str, list[int]] = {}
        for r, row in enumerate(rows):
            by_verifier.setdefault(row.meta.get("verifier", "short_answer"), []).append(r)
        for verifier, members in by_verifier.items():
            if verifier == "short_answer":
                for r in members:
                    texts = [after_reasoning(c, self.ecfg.reasoning_end) for c in rows[r].completions]
                    self.failures["reasoning_unclosed"] += sum(t is None for t in texts)
                    out[r] = [0.0 if t is None else float(answers_match(t, rows[r].reference)) for t in texts]
                continue
            flat, answers, prompts, metas = [], [], [], []
            for r in members:
                meta = {k: v for k, v in rows[r].meta.items() if k in ("choices", "answer", "precision")}
                for c in rows[r].completions:
                    flat.append(c)
                    answers.append(rows[r].reference)
                    prompts.append(str(rows[r].meta.get("problem", "")))
                    metas.append(meta)
            batch = self._manager().score(flat, answers, prompts, metas, only=[verifier])
            self.failures["timeouts"] += batch.timeouts
            self.failures["errors"] += batch.errors
            self.failures["reasoning_unclosed"] += batch.unclosed
            values = batch.per_reward[verifier]
            at = 0
            for r in members:
                k = len(rows[r].completions)
                out[r] = [float(v) for v in values[at:at + k]]
                at += k
        return out

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
            self.manager = None


def merge_verifier_failures(parts) -> dict[str, int]:
    """The verifier failures of all ranks from (data-parallel rank, counts) pairs: the tp / cp ranks of a
    group scored the same rows, so each shard counts once."""
    by_shard = dict(parts)
    return {k: sum(c.get(k, 0) for c in by_shard.values()) for k in ("timeouts", "errors", "reasoning_unclosed")}


def _progress(name: str, what: str, is_main: bool):
    t0 = time.perf_counter()
    last = [0.0]

    def report(done: int, total: int) -> None:
        now = time.perf_counter() - t0
        if is_main and (done == total or now - last[0] >= 10.0 or done == 1):
            last[0] = now
            log.info("eval %s (%s): batch %d/%d, %.1f s", name, what, done, total, now)
    return report


def evaluate_benchmark(ctx: RunContext, bundle: ModelBundle, engine, bcfg: BenchmarkConfig, scorer: VerifierScorer,
                       *, bench_index: int = 0) -> dict:
    """The results of one benchmark (the same dict on every rank; collective)."""
    ecfg: EvalConfig = ctx.cfg.eval
    env = ctx.env
    opened = open_benchmark(bcfg, template=bcfg.prompt_template or ecfg.prompt_template, system_prompt=ecfg.system_prompt,
                            key=f"eval.benchmarks[{bench_index}].path")
    bad = BadRecordLog()
    keep_planning_records(opened.bad_records, bad)  # every rank opened the files and found the same bad lines
    prompt_budget = ctx.cfg.data.max_tokens_per_pack - ecfg.max_new_tokens
    if prompt_budget < MIN_PROMPT_TOKENS:  # refused with the config (mode_keys); a caller that skipped it
        raise ValueError(f"data.max_tokens_per_pack: {ctx.cfg.data.max_tokens_per_pack} leaves {prompt_budget} tokens for "
                         f"a prompt before eval.max_new_tokens = {ecfg.max_new_tokens}; raise it")
    data_cfg = dataclasses.replace(ctx.cfg.data, max_tokens_per_pack=prompt_budget)
    local: list[dict] = []
    failures_before = dict(scorer.failures)
    dp_rank = getattr(bundle.dims, "dp_rank", env.rank)
    try:
        # the data-parallel coordinate, not the rank: the tp / cp ranks of a group decode the same rows together
        # (env.rank with tp = 2 gave rank 1 "dp_rank must be in [0, 1)": it skipped the benchmark, rank 0 hung)
        loader = build_eval_dataloader(data_cfg, bundle.processor, dp_rank=dp_rank, dp_size=bundle.dims.dp_size,
                                       mode="generation", batch_size=ecfg.batch_size, padding_side="left",
                                       bad_records=bad, source=opened.source)
    except ValueError as e:  # no usable row at all: reported, not fatal for the other benchmarks
        log.warning("eval %s: %s", bcfg.name, e)
        loader = None
    modes = (["greedy"] if ecfg.greedy else []) + (["samples"] if ecfg.samples else [])
    skipped = dict.fromkeys(modes, len(bad))  # rows no pass can score (opening, planning: global rank 0 holds them)
    if loader is not None:
        stop = tuple(ecfg.stop)
        rows_by_index: dict[int, dict] = {}
        if ecfg.greedy:
            params = SamplingParams(max_new_tokens=ecfg.max_new_tokens, temperature=0.0, stop=stop)
            with _pass_skips(loader, bad, skipped, "greedy"):
                rows = generate_answers(bundle, engine, loader, params, progress=_progress(bcfg.name, "greedy", env.is_main))
            for row, scores in zip(rows, scorer.score(rows)):
                rows_by_index[row.index] = _row_record(row) | {"greedy": row.completions[0], "greedy_score": scores[0]}
        if ecfg.samples:
            params = SamplingParams(max_new_tokens=ecfg.max_new_tokens, n=ecfg.samples, temperature=ecfg.temperature,
                                    top_p=ecfg.top_p, top_k=ecfg.top_k, stop=stop)
            gen = sampling_generator(ctx.cfg.train.seed, bench_index, dp_rank, env.device, salt=_SAMPLING_SALT)
            with _pass_skips(loader, bad, skipped, "samples"):
                rows = generate_answers(bundle, engine, loader, params, generator=gen,
                                        progress=_progress(bcfg.name, f"{ecfg.samples} samples", env.is_main))
            for row, scores in zip(rows, scorer.score(rows)):
                rows_by_index.setdefault(row.index, _row_record(row)).update(samples=row.completions, sample_scores=scores)
        local = list(rows_by_index.values())
    failures = {k: scorer.failures[k] - failures_before[k] for k in failures_before}
    parts = all_gather_objects({"rows": local, "bad": (dp_rank, bad.to_dict()["records"]),
                                "failures": (dp_rank, failures), "skipped": (dp_rank, skipped)})
    merged_bad = merge_by_shard(p["bad"] for p in parts)  # tp / cp ranks skipped the same rows: counted once
    skipped_shards = dict(p["skipped"] for p in reversed(parts))  # the first rank of each shard, as merge_by_shard
    bad_dict = merged_bad.to_dict() | {"skipped_by_mode": {m: sum(s[m] for s in skipped_shards.values()) for m in modes}}
    by_index: dict[int, dict] = {}
    for p in parts:  # the ranks of one data-parallel group (tp, cp) hold the same rows: each row once
        for r in p["rows"]:
            by_index.setdefault(r["index"], r)
    rows_all = [by_index[i] for i in sorted(by_index)]
    # the rows of the files (of the first max_samples), those refused while opening them included: scored + bad
    num_rows = len(opened.source) + len(opened.bad_records)
    return {"name": bcfg.name, "format": bcfg.format, "path": bcfg.path, "num_rows": num_rows,
            "metrics": _metrics(rows_all, ecfg), "verifiers": dict(Counter(r["verifier"] for r in rows_all)),
            "verifier_failures": merge_verifier_failures(p["failures"] for p in parts),
            "bad_records": bad_dict, "rows": rows_all}


@contextmanager
def _pass_skips(loader, bad: BadRecordLog, skipped: dict[str, int], mode: str):
    """Count the rows one decoding pass over `loader` skipped in `skipped[mode]` and add them to `bad` once: every
    pass processes the same rows, so a row that fails fails in each, and it is one skipped row of the benchmark
    (the loader's own log counted it once per pass: num_skips 2 for a row of a greedy + sampled evaluation)."""
    loader.bad_records = this_pass = BadRecordLog()
    try:
        yield
    finally:
        loader.bad_records = bad
        skipped[mode] += len(this_pass)
        have = {(r.source, r.index, r.category) for r in bad.entries}
        for r in this_pass.entries:
            if (r.source, r.index, r.category) not in have:
                bad.add(r.source, r.index, r.category, r.detail)


def _row_record(row: GeneratedAnswers) -> dict:
    group = row.meta.get("question_type")
    return {"index": row.index, "id": row.meta.get("id"), "answer": row.reference,
            "verifier": row.meta.get("verifier", "short_answer"), "group": group if isinstance(group, str) else None}


def _metrics(rows: list[dict], ecfg: EvalConfig) -> dict:
    thr = ecfg.correct_threshold
    out: dict = {"num_scored": len(rows)}
    greedy = [r["greedy_score"] for r in rows if "greedy_score" in r]
    if ecfg.greedy:
        out["greedy_accuracy"] = sum(s >= thr for s in greedy) / len(greedy) if greedy else None
        groups: dict[str, list[bool]] = {}
        for r in rows:  # per question type (first-seen order), as the training-time answer accuracy reports it
            if r.get("group") is not None and "greedy_score" in r:
                groups.setdefault(r["group"], []).append(r["greedy_score"] >= thr)
        for name, hits in groups.items():
            out[f"greedy_accuracy/{name}"] = sum(hits) / len(hits)
    sampled = [r["sample_scores"] for r in rows if "sample_scores" in r]
    if ecfg.samples:
        k = ecfg.samples
        out[f"avg@{k}"] = avg_at_k(sampled, thr) if sampled else None
        out[f"pass@{k}"] = (sum(pass_at_k(k, sum(s >= thr for s in row), k) for row in sampled) / len(sampled)
                            if sampled else None)
    return out
