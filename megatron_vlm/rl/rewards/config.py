"""Config schema of the `[[rl.rewards]]` tables: one dataclass per verifier type.

A GRPO run scores every completion with a weighted sum of verifiers. Each entry of `rl.rewards` is
a TOML table whose `type =` picks the verifier (the strict loader discriminates the union by the
`type: Literal[...]` field of each class); the other keys are that verifier's options, so a typo in
an option is a config error instead of a silently ignored setting. `type = "custom"` runs any
Python function named by its dotted path (`function = "my_pkg.rewards.length_penalty"`).

This module imports nothing heavy: reward worker processes import it at start-up.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

__all__ = [
    "MathRewardConfig",
    "ChoiceRewardConfig",
    "FormatRewardConfig",
    "ExactMatchRewardConfig",
    "CustomRewardConfig",
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
class MathRewardConfig(_RewardCommon):
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
    """Relative tolerance for numeric equality (absolute 1e-9 near zero)."""
    answer_tag: Optional[str] = None
    """Tag name whose content is also an answer candidate, e.g. "answer" for <answer>...</answer>."""

    def validate(self) -> None:
        self._validate_common()
        if not 0 <= self.rel_tol < 1:
            raise ValueError(f"rel_tol: must be in [0, 1), got {self.rel_tol}")


@dataclass(kw_only=True)
class ChoiceRewardConfig(_RewardCommon):
    type: Literal["choice"] = "choice"
    """Multiple choice: the chosen option (a letter like "B", "(B)", "Option B", or the option's
    text) equals the reference (a letter or the option text). Options come from the sample's
    `choices` metadata or are parsed from the prompt ("A. ...", "(B) ...", "C: ...")."""
    letters: str = "ABCDEFGHIJ"
    """Valid option letters, in order."""

    def validate(self) -> None:
        self._validate_common()
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
class ExactMatchRewardConfig(_RewardCommon):
    type: Literal["exact_match"] = "exact_match"
    """Exact match of the extracted answer with the reference after normalisation (whitespace,
    surrounding `$`, trailing period, and optionally case)."""
    case_sensitive: bool = False
    """Compare case-sensitively."""
    extract: bool = True
    """Compare the extracted final answer (boxed / "answer:" phrase / last line); false compares the
    whole completion."""

    def validate(self) -> None:
        self._validate_common()


@dataclass(kw_only=True)
class CustomRewardConfig(_RewardCommon):
    type: Literal["custom"] = "custom"
    """Any Python function, imported by dotted path in the reward worker and called as
    `fn(completion, answer, prompt=..., metadata=..., **kwargs) -> float`."""
    function: str = ""
    """Dotted path of the function, e.g. "my_pkg.rewards.length_penalty"."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed to the function."""

    def validate(self) -> None:
        self._validate_common()
        if not _DOTTED_PATH.match(self.function):
            raise ValueError(f"function: expected a dotted path like 'pkg.module.fn', got {self.function!r}")
        reserved = {"prompt", "metadata"} & set(self.kwargs)
        if reserved:
            raise ValueError(f"kwargs: {sorted(reserved)} are passed by the reward manager; rename them")


RewardConfig = Union[MathRewardConfig, ChoiceRewardConfig, FormatRewardConfig, ExactMatchRewardConfig, CustomRewardConfig]

REWARD_CONFIG_TYPES: dict[str, type[RewardConfig]] = {
    "math": MathRewardConfig,
    "choice": ChoiceRewardConfig,
    "format": FormatRewardConfig,
    "exact_match": ExactMatchRewardConfig,
    "custom": CustomRewardConfig,
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
