"""Prompt encoding: a `PromptSample` into the rollout engine's `RolloutPrompt`, through the SFT data pipeline.

A prompt is encoded by the data pipeline (`process_record(..., for_generation=True)`: chat template, image
preprocessing, placeholder expansion, the `[data]` pixel caps and video decode timeout), so rollouts
see exactly the tokens SFT trains on. A prompt that cannot be encoded, or whose prompt +
`max_new_tokens` exceeds `data.max_tokens_per_pack`, is skipped and counted instead of stopping the
run: every exception of one prompt's encoding (a BadRecordError with its category, a
decompression-bomb image as "image_too_large", anything else as "unexpected_error" with its type and
message, the first one logged with a traceback) is a bad record under the prompt's file and line /
row, so the same prompt met again after a resume is skipped again, never fatal.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Optional

from megatron_vlm.data.bad_records import BadRecordError, BadRecordLog, unexpected
from megatron_vlm.data.media import DEFAULT_LIMITS, MediaLimits
from megatron_vlm.data.processing import process_record
from megatron_vlm.errors import ConfigError
from megatron_vlm.inference.engine import RolloutPrompt
from megatron_vlm.rl.prompts.dataset import PromptSample

__all__ = ["PromptEncoder"]

log = logging.getLogger("megatron_vlm")


class PromptEncoder:
    """PromptSample -> RolloutPrompt through the data pipeline, with a per-run skip count and a log of
    the prompts that failed (`bad_records`: by the sample's file and line / row, with the category).

    `limits`: the `[data]` pixel caps and video decode timeout (`MediaLimits.from_config(cfg.data)`);
    default: the `[data]` defaults."""

    def __init__(self, processor, *, max_frames: int, fps: float, max_new_tokens: int, max_tokens: int,
                 limits: Optional[MediaLimits] = None, bad_records: Optional[BadRecordLog] = None):
        if max_new_tokens >= max_tokens:
            raise ConfigError(
                f"data.max_tokens_per_pack: {max_tokens} leaves no room for a prompt before rl.rollout.max_new_tokens = "
                f"{max_new_tokens} generated tokens; raise it above prompt length + max_new_tokens"
            )
        self.processor = processor
        self.max_frames, self.fps = max_frames, fps
        self.max_prompt_tokens = max_tokens - max_new_tokens
        self.limits = limits or DEFAULT_LIMITS
        self.bad_records = bad_records if bad_records is not None else BadRecordLog()
        self.skipped = 0
        self.last_skip: Optional[str] = None
        """`<prompt id>: <category>: <detail>` of the latest skipped prompt (named when a whole step is unusable)."""
        self._warned = 0

    def encode(self, sample: PromptSample, *, literal_texts: Sequence[str] = ()) -> Optional[RolloutPrompt]:
        """The encoded prompt, or None (counted, logged for the first few) if it cannot be used. `literal_texts`:
        untrusted texts the sample's text holds as markers, read as plain text (`process_record`)."""
        try:
            processed = process_record(sample.to_record(), self.processor, max_frames=self.max_frames, fps=self.fps,
                                       for_generation=True, limits=self.limits, literal_texts=literal_texts)
        except Exception as e:  # every per-prompt failure is a counted bad record (module docstring)
            self._skip(sample, unexpected(e, f"prompt {sample.prompt_id}"))
            return None
        if len(processed) > self.max_prompt_tokens:
            self._skip(sample, BadRecordError(
                "too_long", f"prompt of {len(processed)} tokens + max_new_tokens exceeds data.max_tokens_per_pack"))
            return None
        return RolloutPrompt.from_processed(processed)

    def _skip(self, sample: PromptSample, err: BadRecordError) -> None:
        self.skipped += 1
        self.bad_records.add_error(sample.source or sample.prompt_id, sample.index, err)
        why = str(err)
        self.last_skip = f"{sample.prompt_id}: {why}"
        if self._warned < 5:
            self._warned += 1
            log.warning("GRPO prompt %s skipped: %s", sample.prompt_id, why)
