"""Config schema of the `[[rl.rewards]]` tables: one dataclass per verifier type.

A GRPO run scores every completion with a weighted sum of verifiers. Each entry of `rl.rewards` is
a TOML table whose `type =` picks the verifier (the strict loader discriminates the union by the
`type: Literal[...]` field of each class); the other keys are that verifier's options, so a typo in
an option is a config error instead of a silently ignored setting. `type = "custom"` runs any
Python function named by its dotted path (`function = "my_pkg.rewards.length_penalty"`). Two kinds are
models rather than functions and run in the training process, not in the worker pool (docs/reward_models.md):
`type = "model"` (a sequence-classification reward model folder, its scalar score is the reward) and
`type = "judge"` (a generative VLM answers a templated question about the completion and the image).

This module imports nothing heavy: reward worker processes import it at start-up.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional, Union

__all__ = [
    "MathRewardConfig",
    "ChoiceRewardConfig",
    "FormatRewardConfig",
    "ExactMatchRewardConfig",
    "CustomRewardConfig",
    "ModelRewardConfig",
    "JudgeRewardConfig",
    "MODEL_REWARD_TYPES",
    "RewardConfig",
    "REWARD_CONFIG_TYPES",
    "reward_from_dict",
]

_DOTTED_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


@dataclass(kw_only=True)
class _RewardCommon:
    weight: float = 1.0
    """Weight of this verifier in the summed reward."""
    name: Optional[str] = None
    """Label used in metrics (`reward/<name>`); defaults to the type."""

    def label(self) -> str:
        return self.name or self.type  # type: ignore[attr-defined]

    def _validate_common(self) -> None:
        if self.weight != self.weight or self.weight in (float("inf"), float("-inf")):
            raise ValueError(f"weight: must be finite, got {self.weight}")
        if self.name is not None and not re.fullmatch(r"[A-Za-z0-9_.\-]+", self.name):
            raise ValueError(f"name: use letters, digits, '_', '-', '.', got {self.name!r}")


@dataclass(kw_only=True)
class _AfterReasoning:
    """The `reasoning_end` key of the verifiers that score an answer (math, choice, exact_match, custom).

    Why: a reasoning model writes `<think> ... </think>` before its answer, and a `\\boxed{5}` or a letter tried
    inside the reasoning would be read as the answer. Not on `format` (it reads the reasoning block itself:
    `think_end`) nor on the model rewards (scored in the training process from the whole completion)."""
    reasoning_end: str = ""
    """Score only the text after the last occurrence of this string, e.g. "</think>" for a reasoning model
    ("" = the whole completion). A completion without it (the reasoning never closed, e.g. cut at
    max_new_tokens) scores 0 without calling the verifier, counted in `reward/reasoning_unclosed`."""

    def _validate_reasoning_end(self) -> None:
        # "</think> " would miss every "</think>\n"; " " would cut at the last space
        if self.reasoning_end != self.reasoning_end.strip():
            raise ValueError(f"reasoning_end: no leading or trailing whitespace, got {self.reasoning_end!r}")


def _validate_answer_tag(tag: Optional[str]) -> None:
    # "<answer>" or "answer " would never match the <answer>...</answer> block the user means
    if tag is not None and (not tag or not all(c.isalnum() or c in "_-:." for c in tag)):
        raise ValueError(f"answer_tag: a tag name such as \"answer\" (no brackets or spaces), got {tag!r}")


@dataclass(kw_only=True)
class MathRewardConfig(_AfterReasoning, _RewardCommon):
    type: Literal["math"] = "math"
    """Math answer verification: the final answer (an `answer_tag` block when set, else the last
    `\\boxed{}`, else a "final answer is ..." / "answer: ..." phrase, else the last math environment)
    equals the reference numerically, symbolically, as a set / interval / relation / matrix. LaTeX is
    parsed by our own parser into sympy objects; text is never evaluated. Answer forms:
    megatron_vlm/rl/rewards/README.md."""
    fallback_last_math: bool = True
    """If no boxed / phrased answer is found, use the last math environment ($...$, \\[...\\], ...)."""
    fallback_last_number: bool = False
    """If no boxed / phrased answer or math environment is found, use the last number in the completion."""
    rel_tol: float = 1e-6
    """Relative tolerance for numeric equality (absolute 1e-9 near zero); two integers compare exactly."""
    answer_tag: Optional[str] = None
    """Tag name whose content is also an answer candidate, e.g. "answer" for <answer>...</answer>."""

    def validate(self) -> None:
        self._validate_common()
        self._validate_reasoning_end()
        _validate_answer_tag(self.answer_tag)
        if not 0 <= self.rel_tol < 1:
            raise ValueError(f"rel_tol: must be in [0, 1), got {self.rel_tol}")


@dataclass(kw_only=True)
class ChoiceRewardConfig(_AfterReasoning, _RewardCommon):
    type: Literal["choice"] = "choice"
    """Multiple choice: the chosen option (a letter like "B", "(B)", "Option B", a letter followed by
    the option's text or a reason, "B. 42", "B, 42", "B; because ...", the option's text, or
    the value of exactly one option in another form, "\\frac{1}{2}" for "1/2") equals the reference
    (a letter or the option text); a letter followed by other text ("B, C and D are wrong") selects
    nothing. Options come from the sample's
    `choices` metadata or are parsed from the prompt ("A. ...", "(B) ...", "C: ...")."""
    letters: str = "ABCDEFGHIJ"
    """Valid option letters, in order."""
    answer_tag: Optional[str] = None
    """Tag name whose last block is the answer when the completion has one, e.g. "answer" for
    <answer>B</answer> (as `math`'s); without such a block the usual extraction applies."""

    def validate(self) -> None:
        self._validate_common()
        self._validate_reasoning_end()
        _validate_answer_tag(self.answer_tag)
        if not self.letters or not self.letters.isalpha() or len(set(self.letters.upper())) != len(self.letters):
            raise ValueError(f"letters: must be distinct letters, got {self.letters!r}")


@dataclass(kw_only=True)
class FormatRewardConfig(_RewardCommon):
    type: Literal["format"] = "format"
    """Format: a non-empty reasoning block (`think_start` ... `think_end`) at the start, followed by
    a non-empty answer (optionally inside `answer_start` ... `answer_end`, optionally boxed).
    Gives 1.0 when the completion has that shape, else 0.0."""
    think_start: str = "<think>"
    """Opening marker of the reasoning block ("" = the completion may start with the reasoning)."""
    think_end: str = "</think>"
    """Closing marker of the reasoning block; must occur exactly once."""
    answer_start: Optional[str] = None
    """If set, the answer after the reasoning must be wrapped in answer_start ... answer_end."""
    answer_end: Optional[str] = None
    """Closing marker of the answer block (required when answer_start is set)."""
    require_boxed: bool = False
    """The answer part must contain a `\\boxed{...}`."""

    def validate(self) -> None:
        self._validate_common()
        if not self.think_end:
            raise ValueError("think_end: must not be empty")
        if (self.answer_start is None) != (self.answer_end is None):
            raise ValueError("answer_start / answer_end: set both or neither")


@dataclass(kw_only=True)
class ExactMatchRewardConfig(_AfterReasoning, _RewardCommon):
    type: Literal["exact_match"] = "exact_match"
    """Exact match of the extracted answer with the reference after normalisation (whitespace,
    surrounding `$`, trailing period, and optionally case)."""
    case_sensitive: bool = False
    """Compare case-sensitively."""
    extract: bool = True
    """Compare the extracted final answer (boxed / "answer:" phrase / last line); false compares the
    whole completion."""
    answer_tag: Optional[str] = None
    """Tag name whose last block is the answer when the completion has one, e.g. "answer" for
    <answer>Paris</answer> (as `math`'s); needs extract = true."""

    def validate(self) -> None:
        self._validate_common()
        self._validate_reasoning_end()
        _validate_answer_tag(self.answer_tag)
        if self.answer_tag is not None and not self.extract:
            raise ValueError("answer_tag: reads the extracted answer; with extract = false the whole completion is "
                             "compared (set extract = true or remove answer_tag)")


@dataclass(kw_only=True)
class CustomRewardConfig(_AfterReasoning, _RewardCommon):
    type: Literal["custom"] = "custom"
    """Any Python function, imported by dotted path in the reward worker and called as
    `fn(completion, answer, prompt=..., metadata=..., **kwargs) -> float`."""
    function: str = ""
    """Dotted path of the function, e.g. "my_pkg.rewards.length_penalty": a module on PYTHONPATH, installed, or in
    the folder the job starts in (searched last)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed to the function."""

    def validate(self) -> None:
        self._validate_common()
        self._validate_reasoning_end()
        if not _DOTTED_PATH.match(self.function):
            raise ValueError(f"function: expected a dotted path like 'pkg.module.fn', got {self.function!r}")
        reserved = {"prompt", "metadata"} & set(self.kwargs)
        if reserved:
            raise ValueError(f"kwargs: {sorted(reserved)} are passed by the reward manager; rename them")


@dataclass(kw_only=True)
class ModelRewardConfig(_RewardCommon):
    PATHS: ClassVar[tuple[str, ...]] = ("path",)  # filesystem paths: a leading ~ is expanded (config/loader.py)
    type: Literal["model"] = "model"
    """A learned reward model: the scalar score of a sequence-classification model folder for the prompt
    (with its images, when the model reads images) followed by the completion as the assistant turn, rendered
    with the folder's own chat template. The folder is a transformers `...ForSequenceClassification` checkpoint
    of a supported family (`Qwen2ForSequenceClassification`, `Qwen3ForSequenceClassification`, ...) or one of our
    VLM families with the same scalar head (`score.weight`, written by `rl.rewards.score_model.save_score_model`).
    Scored in batches on the training ranks after the rollout, one full copy per rank (as the reference model).
    The completion is scored as written: special-token strings in its text ("<|im_end|>" typed as characters) are
    plain text, and one over `max_tokens` is scored truncated; a completion that cannot be scored (a forward that
    raises, a NaN score, a prompt that alone fills `max_tokens`) gets `failure_value` and is counted
    (`reward/errors`)."""
    path: str = ""
    """The reward model folder (config.json with a `...ForSequenceClassification` architecture, safetensors,
    tokenizer / processor files)."""
    batch_size: int = 16
    """Completions scored per forward (one packed batch)."""
    max_tokens: int = 4096
    """Longest input of the reward model, in its own tokens. A longer prompt + completion is scored truncated, as
    verl's reward model worker does: the prompt, the completion's first tokens and the template's turn close (the
    score is read where the model reads a whole turn), counted in `reward/truncated`; a prompt that alone leaves no
    room for a completion token is not scored (`failure_value`). The reward model re-renders the conversation with
    its own template and tokenizer, so the policy's `data.max_tokens_per_pack` (the bound on its prompt +
    completion) does not bound this count exactly: set max_tokens at least that (within the model's context) for
    no truncation. At most the folder's `max_position_embeddings` (config.json; a VLM's text model's): above it the
    run and `--check` refuse the key (exit 2), as vLLM refuses a longer `max_model_len`."""
    activation: Literal["none", "sigmoid", "softmax"] = "none"
    """Reward from the logits: "none" = the logit of column `logit_index` as is (a Bradley-Terry reward model);
    "sigmoid" = its sigmoid (a model trained with a binary cross-entropy on correct / wrong, reward in [0, 1]);
    "softmax" = the probability of class `logit_index` (a model with num_labels >= 2)."""
    logit_index: int = 0
    """Column of the logits that is the reward (0 for a num_labels = 1 model)."""
    failure_value: Optional[float] = None
    """Reward of a completion the model cannot score (counted in `reward/errors`). Unset: 0 with "sigmoid" /
    "softmax" (the bottom of their range) and, with "none", the lowest score the model gave in the same scoring
    call (each rank scores its own completions; 0 when it scored none). Why: a Bradley-Terry score has either
    sign, so a fixed 0 would rank a failure above every completion scored below 0 and the policy would learn to
    fail; the lowest score never ranks it above a scored one. A number: that reward (with "none", set it below
    the scores the model gives)."""
    offload: bool = False
    """Keep the reward model on the CPU between scorings (moved to the device only while it scores)."""

    def validate(self) -> None:
        self._validate_common()
        if not self.path:
            raise ValueError("path: the reward model folder is required")
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {self.batch_size}")
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens: must be >= 2, got {self.max_tokens}")
        if self.logit_index < 0:
            raise ValueError(f"logit_index: must be >= 0, got {self.logit_index}")
        if self.failure_value is not None and not math.isfinite(self.failure_value):
            raise ValueError(f"failure_value: must be a finite number, got {self.failure_value}")


_JUDGE_FIELDS = ("question", "completion", "reference")
_DEFAULT_JUDGE_TEMPLATE = ("Question: {question}\nReference answer: {reference}\nResponse: {completion}\n"
                           "Is the response correct? Answer yes or no.")


@dataclass(kw_only=True)
class JudgeRewardConfig(_RewardCommon):
    PATHS: ClassVar[tuple[str, ...]] = ("path",)  # filesystem paths: a leading ~ is expanded (config/loader.py)
    type: Literal["judge"] = "judge"
    """A generative judge: a VLM folder answers `template` (filled with the question, the completion and the
    reference answer) about the prompt's images, greedily, through the rollout engine
    (megatron_vlm/inference); its answer is parsed into the reward (`parse`). Runs on the training ranks
    after the rollout, one copy per rank; an answer that cannot be parsed scores 0 and is counted
    (`reward/errors`)."""
    path: str = ""
    """The judge model folder (a generative model of a supported family, with its tokenizer / processor)."""
    template: str = _DEFAULT_JUDGE_TEMPLATE
    """The judge's user turn; fields {question} (the prompt's text), {completion}, {reference} (the
    dataset's answer), written bare (no conversion or format spec). Literal braces are doubled ({{ }}). The filled
    texts are read as written: special-token strings in them ("<|im_end|>" typed by the policy) are plain text to
    the judge, the images' tokens stay special. The template's own text may not hold what no prompt's text may: an
    image / video placeholder or a turn / end token of the judge (e.g. "<|im_end|>": the judge's chat template writes
    the turn tokens); the run and `--check` refuse it (exit 2). Other special tokens (Qwen's "<|box_start|>") are
    text it may hold."""
    parse: Literal["yes_no", "score"] = "yes_no"
    """How the answer becomes the reward: "yes_no" = 1 when its first word is yes, 0 when no; "score" = the
    first number of the answer divided by `max_score` (a number outside [0, max_score] is clipped and counted). A
    judge that reasons first (`<think> ... </think>`) is read after its reasoning; one cut inside it is an error."""
    max_score: Optional[float] = None
    """The top of the judge's scale with parse = "score" (unset: 10)."""
    max_new_tokens: int = 8
    """Tokens the judge may generate per answer."""
    max_tokens: int = 4096
    """Longest judge prompt + max_new_tokens; a longer judge prompt is not asked: 0, counted as an error. At most
    the folder's `max_position_embeddings` (config.json; a VLM's text model's): above it the run and `--check`
    refuse the key (exit 2)."""
    images: bool = True
    """Show the judge the prompt's images (before the template's text); false = text only."""
    batch_size: int = 16
    """Judge prompts decoded together (slots of the judge's engine)."""
    offload: bool = False
    """Keep the judge on the CPU between scorings (moved to the device only while it answers)."""

    def validate(self) -> None:
        import string

        self._validate_common()
        if not self.path:
            raise ValueError("path: the judge model folder is required")
        try:
            parsed = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(self.template) if f is not None]
        except ValueError as e:
            raise ValueError(f"template: {e} (write literal braces as {{{{ }}}})") from None
        names = [f for f, _, _ in parsed]
        odd = [f for f, spec, conv in parsed if spec or conv]
        if odd:  # the filled texts are placed as written (their special-token strings read as plain text)
            raise ValueError(f"template: field {odd[0]!r} has a conversion or format spec; write it bare, "
                             f"{{{odd[0]}}}")
        bad = sorted({n for n in names if n not in _JUDGE_FIELDS})
        if bad:
            raise ValueError(f"template: unknown fields {bad}; use {{question}}, {{completion}}, {{reference}}")
        if "completion" not in names:
            raise ValueError("template: must contain {completion} (what the judge judges)")
        if self.parse == "yes_no" and self.max_score is not None:
            raise ValueError("max_score: only read with parse = 'score'; leave it unset")
        if self.max_score is not None and not (0 < self.max_score < float("inf")):
            raise ValueError(f"max_score: must be finite and > 0, got {self.max_score}")
        for name in ("max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_tokens <= self.max_new_tokens:
            raise ValueError(f"max_tokens: must exceed max_new_tokens ({self.max_new_tokens}), got {self.max_tokens}")

    def scale(self) -> float:
        """The top of the score scale (parse = "score")."""
        return self.max_score if self.max_score is not None else 10.0


RewardConfig = Union[MathRewardConfig, ChoiceRewardConfig, FormatRewardConfig, ExactMatchRewardConfig, CustomRewardConfig,
                     ModelRewardConfig, JudgeRewardConfig]

MODEL_REWARD_TYPES = ("model", "judge")
"""The kinds scored by a model in the training process (not by the worker pool)."""

REWARD_CONFIG_TYPES: dict[str, type[RewardConfig]] = {
    "math": MathRewardConfig,
    "choice": ChoiceRewardConfig,
    "format": FormatRewardConfig,
    "exact_match": ExactMatchRewardConfig,
    "custom": CustomRewardConfig,
    "model": ModelRewardConfig,
    "judge": JudgeRewardConfig,
}



def reward_from_dict(table: dict, where: str = "rl.rewards[0]") -> Any:
    """Build one reward config from a TOML table (for code paths that bypass the config loader).

    Raises ValueError naming `where` and the offending key."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a table, got {type(table).__name__}")
    kind = table.get("type")
    if kind not in REWARD_CONFIG_TYPES:
        raise ValueError(f"{where}.type: must be one of {sorted(REWARD_CONFIG_TYPES)}, got {kind!r}")
    cls = REWARD_CONFIG_TYPES[kind]
    valid = {f for f in cls.__dataclass_fields__}
    for key in table:
        if key not in valid:
            raise ValueError(f"{where}.{key}: unknown key for type {kind!r}; valid keys: {', '.join(sorted(valid))}")
    obj = cls(**table)
    try:
        obj.validate()
    except ValueError as e:
        raise ValueError(f"{where}.{e}") from None
    return obj
