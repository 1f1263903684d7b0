"""The `[eval]` config section of an evaluation job (`[train] mode = "eval"`, `launch/evaluate.py`):
which benchmark files to score, with which verifier, greedy and / or sampled.

One `[[eval.benchmarks]]` table per benchmark file: `format` picks the column adapter of a known
release (eval/benchmarks.py documents the columns each expects), `columns` renames columns for a
copy whose names differ, `verifier` overrides the preset's scorer. The verifiers are the GRPO
reward verifiers (`math`, `choice`, `exact_match`), plus `short_answer`: the first-word comparison
of the training-time answer accuracy (eval/answers.py), so a model evaluated here on an SFT run's
held-out set scores what that run reported.

Torch-free like every config section (the strict loader imports it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional

__all__ = ["EvalConfig", "BenchmarkConfig", "BENCHMARK_FORMATS", "VERIFIERS", "MIN_PROMPT_TOKENS"]

BENCHMARK_FORMATS = ("geometry3k", "mathvista", "mathvision", "logicvista", "mmmu", "messages", "columns")
VERIFIERS = ("auto", "math", "choice", "exact_match", "short_answer")
AUTO_WITHOUT_MATH = ("logicvista",)
"""Formats whose "auto" verifier is never math (eval/benchmarks.py FORMATS: choice with or without options)."""
MIN_PROMPT_TOKENS = 16
"""The least prompt budget (data.max_tokens_per_pack - eval.max_new_tokens) an evaluation accepts."""


@dataclass(kw_only=True)
class BenchmarkConfig:
    PATHS: ClassVar[tuple[str, ...]] = ("path", "image_root")  # filesystem paths: a leading ~ is expanded (config/loader.py)
    name: str
    """Name of the benchmark in the results (a row of the table)."""
    path: str
    """A .parquet / .arrow / .jsonl / .json file, a folder (searched recursively) or a glob, read locally."""
    format: Literal["geometry3k", "mathvista", "mathvision", "logicvista", "mmmu", "messages", "columns"] = "columns"
    """Column adapter: a public release's layout (geometry3k = hiyouga/geometry3k, mathvista =
    AI4Math/MathVista testmini, mathvision = MathLLMs/MathVision, logicvista = LogicVista, mmmu =
    MMMU-style multiple choice), "messages" (messages JSONL whose last assistant turn is the answer,
    e.g. an SFT held-out split) or "columns" (only the `columns` table)."""
    columns: dict[str, str] = field(default_factory=dict)
    """Our field -> column, overriding the preset's: question, answer, images (a list or one image),
    choices (a list of option texts), id, precision (decimal places a float answer is rounded to before the math
    verifier compares it, MathVista's rule; null = none; read for rows whose `answer_type` is absent or "float"; refused
    with a verifier that is never math: choice, exact_match, short_answer, or "auto" on logicvista)."""
    verifier: Literal["auto", "math", "choice", "exact_match", "short_answer"] = "auto"
    """Scorer: "auto" = the format's (choice for rows with options, else math; short_answer for
    messages), or one of the verifiers for every row."""
    prompt_template: Optional[str] = None
    """User turn for this benchmark (`{problem}` = question + options); unset = eval.prompt_template."""
    image_root: str = ""
    """Folder relative image paths resolve against; empty = the data file's folder."""
    max_samples: int = 0
    """Evaluate the first N rows only (0 = all); bad rows among them are skipped and counted, not replaced
    by later ones, so a run scores the same rows as another with the same N (format "messages": the first N
    lines that parse as JSON records)."""

    def validate(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").replace(".", "").isalnum():
            raise ValueError(f"name: use letters, digits, '_', '-', '.', got {self.name!r}")
        if not self.path:
            raise ValueError("path: required")
        allowed = {"question", "answer", "images", "choices", "id", "precision"}
        unknown = sorted(set(self.columns) - allowed)
        if unknown:
            raise ValueError(f"columns: unknown key {unknown[0]!r}; allowed: {sorted(allowed)}")
        if "precision" in self.columns:  # read by the math verifier alone (eval/benchmarks.py `_precision`)
            if self.verifier not in ("auto", "math"):
                raise ValueError(f"columns.precision: only the math verifier reads it, and verifier = "
                                 f"{self.verifier!r} scores every row; remove the key or use verifier = 'math'")
            if self.verifier == "auto" and self.format in AUTO_WITHOUT_MATH:
                raise ValueError(f"columns.precision: format {self.format!r} scores every row with the choice "
                                 "verifier (verifier = 'auto'), which does not read it; remove the key or use "
                                 "verifier = 'math'")
        if self.format == "columns" and not {"question", "answer"} <= set(self.columns):
            raise ValueError("columns: format 'columns' needs at least question and answer columns")
        if self.format == "messages" and self.columns:
            raise ValueError("columns: format 'messages' reads the messages column; remove the table")
        if self.prompt_template is not None:
            _check_template(self.prompt_template, "prompt_template")
        if self.max_samples < 0:
            raise ValueError(f"max_samples: must be >= 0, got {self.max_samples}")


def _check_template(template: str, name: str) -> None:
    if "{problem}" not in template:
        raise ValueError(f"{name}: must contain the {{problem}} placeholder")
    try:
        template.format(problem="")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"{name}: only {{problem}} may be a placeholder (literal braces are {{{{ }}}}): {e!r}") from None


@dataclass(kw_only=True)
class EvalConfig:
    PATHS: ClassVar[tuple[str, ...]] = ("adapter",)  # filesystem paths: a leading ~ is expanded (config/loader.py)
    benchmarks: list[BenchmarkConfig] = field(default_factory=list)
    """The benchmark files, one `[[eval.benchmarks]]` table each."""
    adapter: str = ""
    """A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) applied on top of
    model.path; empty = the model as it is."""
    greedy: bool = True
    """Score one greedy (temperature 0) completion per prompt: Avg@1."""
    samples: int = 0
    """Also sample this many completions per prompt (temperature / top_p / top_k below) and report
    Avg@k and pass@k (0 = no sampled pass)."""
    temperature: float = 1.0
    """Sampling temperature of the sampled pass (temperature, top_p and top_k are refused with samples = 0;
    `--set eval.samples=0` drops the file's)."""
    top_p: float = 1.0
    """Nucleus threshold of the sampled pass."""
    top_k: int = 0
    """Top-k of the sampled pass (0 = off)."""
    max_new_tokens: int = 1024
    """Generation budget per completion (a prompt longer than data.max_tokens_per_pack minus this is
    skipped and counted)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (EOS always stops): a completion ends with the token that completes the first one, and the text
    the verifiers score ends right after it, the stop string kept (as the training rewards see a rollout's; unlike
    lm-eval's `until`, which drops it)."""
    batch_size: int = 16
    """Prompts per generation call on one rank (every rank generates; the files are split over ranks)."""
    prompt_template: str = "{problem}"
    """User turn of every benchmark without its own template; `{problem}` = the question (+ options). Refused when
    every benchmark sets its own (never read)."""
    system_prompt: Optional[str] = None
    """Optional system turn."""
    correct_threshold: float = 1.0
    """A completion counts as correct when its verifier score (in [0, 1]) is >= this; in (0, 1]."""
    reward_timeout_s: float = 10.0
    """Time limit of one verifier call (a call past it scores 0 and is counted)."""
    reward_workers: int = 2
    """Verifier worker processes per rank."""
    reasoning_end: str = ""
    """Score only the text after the last occurrence of this string, e.g. "</think>" for a reasoning model, with
    every verifier (short_answer too), as `[[rl.rewards]] reasoning_end` does in training ("" = the whole
    completion). A completion without it scores 0, counted in `verifier_failures.reasoning_unclosed`."""

    def validate(self) -> None:
        # "at least one benchmark" is checked with the mode (config/__init__.py): in another mode [eval] is refused whole
        names = [b.name for b in self.benchmarks]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"benchmarks: duplicate names {dup}")
        if not self.greedy and self.samples == 0:
            raise ValueError("samples: greedy = false and samples = 0 evaluate nothing")
        if self.samples < 0:
            raise ValueError(f"samples: must be >= 0, got {self.samples}")
        if self.samples and self.temperature <= 0:
            raise ValueError(f"temperature: the sampled pass needs temperature > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0, got {self.top_k}")
        for name in ("temperature", "top_p", "top_k"):  # greedy decoding reads none of them
            if not self.samples and getattr(self, name) != getattr(EvalConfig, name):
                raise ValueError(f"{name}: only read by the sampled pass (eval.samples > 0; the greedy pass decodes at "
                                 "temperature 0); remove it or set eval.samples")
        for name in ("max_new_tokens", "batch_size", "reward_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if any(not s for s in self.stop):
            raise ValueError("stop: stop strings must not be empty")
        if not 0 < self.correct_threshold <= 1:  # scores are in [0, 1]: 0 counts every miss, > 1 / NaN no hit
            raise ValueError(f"correct_threshold: must be in (0, 1], got {self.correct_threshold}")
        if not self.reward_timeout_s > 0:
            raise ValueError(f"reward_timeout_s: must be > 0, got {self.reward_timeout_s}")
        if self.reasoning_end != self.reasoning_end.strip():  # "</think> " would miss every "</think>\n"
            raise ValueError(f"reasoning_end: no leading or trailing whitespace, got {self.reasoning_end!r}")
        _check_template(self.prompt_template, "prompt_template")
        if (self.prompt_template != EvalConfig.prompt_template and self.benchmarks
                and all(b.prompt_template is not None for b in self.benchmarks)):  # read for a benchmark without one
            raise ValueError("prompt_template: every [[eval.benchmarks]] table sets its own prompt_template, so this one "
                             "is never read; remove it, or leave prompt_template out of the benchmarks that should take it")
