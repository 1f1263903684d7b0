"""The rollout-engine interface: what a GRPO controller asks of any generator.

An engine turns encoded prompts into `n` sampled completions each, with the token ids and the
behaviour log-probs (log pi_behaviour(token) under the policy version that generated it). Three
operations, so that other back ends can plug in later without touching the trainer:

    load_weights(weights, version)  make the engine generate with policy `version`. The built-in
                                    engine either shares the trainer's parameters (no weights) or
                                    holds its own unsharded copy, refreshed here once per step;
                                    separate rollout ranks or a vLLM server receive the full state
                                    dict here.
    generate(prompts, params)       sample `params.n` completions per prompt; results are
                                    group-major (the n samples of prompt p are p*n ... p*n+n-1), the
                                    layout of `rl.advantages`.
    release_memory()                drop rollout-only memory (KV caches, allocator cache) before
                                    the training phase reuses the device.
    interrupt()                     (optional) stop a running `generate` at a token boundary; it
                                    returns the partial completions with the policy version of
                                    every token (the asynchronous trainer refreshes weights then).

Behaviour log-probs are those of the temperature-scaled, *untruncated* distribution
(log_softmax(logits / temperature)), which is what the trainer recomputes for the PPO ratio;
top-k / top-p only restrict which tokens may be drawn. With temperature 0 (greedy) they are the
log-probs at temperature 1.
A VLM's vision tokens, which no engine samples, are removed from that distribution (renormalised over the
other ids), in the behaviour log-probs and in every RL log-prob of training alike (inference/sampling.py).
"""
from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

from megatron_vlm.data.batch import SampleInputs
from megatron_vlm.table_checks import at_least

__all__ = ["SamplingParams", "RolloutPrompt", "RolloutSample", "RolloutResult", "RolloutEngine"]

FinishReason = Literal["eos", "stop", "length", "interrupted"]


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    """Generation budget per completion; a completion that reaches it ends with reason "length"."""
    n: int = 1
    """Completions per prompt (the GRPO group size G)."""
    temperature: float = 1.0
    """Softmax temperature; 0 = greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: draw only from the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Draw only from the k most likely tokens, and any tied with the k-th, as transformers and vLLM do (0 = off)."""
    stop: tuple[str, ...] = ()
    """Stop strings: a completion ends with the token that completes the first occurrence of any."""

    def __post_init__(self) -> None:
        at_least(self, 1, "max_new_tokens", "n")
        at_least(self, 0, "temperature")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        at_least(self, 0, "top_k")
        if any(not s for s in self.stop):
            raise ValueError("stop: stop strings must not be empty")
        object.__setattr__(self, "stop", tuple(self.stop))


@dataclass
class RolloutPrompt(SampleInputs):
    """One encoded prompt: token ids with the image / video placeholders expanded, and the vision
    inputs of that prompt only (`SampleInputs`, as a `megatron_vlm.data.processing.ProcessedSample` has them)."""

    images: Optional[list] = None
    """The prompt's loaded images (PIL), for engines that process them themselves (vLLM); None: text only."""
    videos: Optional[list] = None
    """The prompt's videos as loaded (`data.media.VideoClip`: kept frames, source indices, rate), for engines that
    process them themselves (vLLM); None: no video."""

    @classmethod
    def from_processed(cls, sample) -> RolloutPrompt:
        """From a `ProcessedSample` (process_record(..., for_generation=True))."""
        return cls(
            input_ids=sample.input_ids, pixel_values=sample.pixel_values, image_grid_thw=sample.image_grid_thw,
            pixel_values_videos=sample.pixel_values_videos, video_grid_thw=sample.video_grid_thw,
            second_per_grid_ts=sample.second_per_grid_ts, images=getattr(sample, "images", None),
            videos=getattr(sample, "videos", None),
        )


@dataclass
class RolloutSample:
    prompt_index: int
    """Index of the prompt in the `generate` call."""
    sample_index: int
    """0 ... n-1 within the prompt's group."""
    token_ids: torch.Tensor
    """[L] int64 generated tokens, including the EOS token when the completion ended on one."""
    logprobs: torch.Tensor
    """[L] float32 behaviour log-probs of `token_ids` (see module docstring)."""
    text: str
    """Decoded completion without special tokens; cut right after the stop string for reason "stop"."""
    finish_reason: FinishReason
    prompt_length: int
    """Tokens of the prompt (for packing and metrics)."""
    policy_version: int = 0
    """Version of the policy that generated the sample (for bounded-staleness asynchronous GRPO); the
    oldest version among its tokens when weights changed during generation."""
    token_versions: Optional[torch.Tensor] = None
    """[L] int64 policy version of every token (an engine whose weights are refreshed while it generates
    mixes versions within a completion); None from engines that do not track it."""
    routes: Optional[torch.Tensor] = None
    """[prompt_length + L - 1, moe_layers, k] int8 / int16: the top-k experts each MoE layer routed every token the
    engine read (prompt, then the generated tokens but the last, which no forward reads) to; None from engines and
    models that do not record (routing replay: megatron_vlm/models/common/routing_replay.py)."""

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class RolloutResult:
    samples: list[RolloutSample]
    """Group-major: samples[p * n + j] is completion j of prompt p."""
    num_generated_tokens: int = 0
    """Generated tokens of all samples of the call."""
    seconds: float = 0.0
    """Wall-clock time of the call."""
    stats: dict[str, float] = field(default_factory=dict)
    """Engine-specific counters (prefill / decode time, forward calls, ...)."""
    interrupted: bool = False
    """The call was stopped by `RolloutEngine.interrupt()`: unfinished samples end with reason
    "interrupted" and hold the tokens generated so far (none for samples that never started)."""

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.seconds if self.seconds > 0 else 0.0


class RolloutEngine(abc.ABC):
    """Interface of a rollout back end (see module docstring)."""

    policy_version: int = 0

    @abc.abstractmethod
    def load_weights(self, weights: Optional[Mapping[str, torch.Tensor]] = None, *, version: int) -> None:
        """Generate with policy `version` from now on; `weights` (Hugging Face names) for engines that
        hold their own copy, None for engines that share the trainer's parameters."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[RolloutPrompt], params: SamplingParams, *,
                 generator: Optional[torch.Generator] = None) -> RolloutResult:
        """`params.n` completions per prompt, group-major."""

    @abc.abstractmethod
    def release_memory(self) -> None:
        """Free memory that only generation needs."""

    def interrupt(self) -> None:  # noqa: B027 -- optional hook: a no-op for engines that cannot stop early
        """Ask a running `generate` (another thread) to stop at the next token boundary and return the
        partial completions. Engines that cannot be interrupted ignore it."""
