"""`[[rl.rewards]] type = "model"`: a learned reward model scores each completion, in batches, in the training process.

Each completion becomes a conversation — the prompt's messages (its images too when the reward model reads
images; a text-only reward model gets the text of the turns) and the completion as the assistant turn —
rendered and tokenised by the reward model folder's own processor (the data pipeline's `process_record`,
as SFT), packed `batch_size` at a time and scored by `SequenceScoreModel` (score_model.py): the logit of
the last token, through `activation`.

Why in-process and not in the reward worker pool: the pool's workers hold no torch and run one call per
process; a network wants batches on the device. The pool's guarantees hold here too, per completion
(`ScoredValues.status`): a completion that cannot be rendered (a missing image, over `max_tokens`), a
batch whose forward raises (its completions), a NaN score, each is reward 0 and an "error" (the run goes
on; `reward/errors` counts it and `rl.reward_pool.max_failed_steps` stops a run whose every call fails);
an infinite or larger-than-`rl.reward_pool.abs_max` score is clipped to +-abs_max ("clipped"). An empty
completion (the policy ended its turn at once) is scored like any other, on the prompt and an empty assistant
turn: a fixed 0 would rank it above every answer the model scores below 0, a reward for answering nothing.

Placement: one full copy per rank, in the run's compute dtype, as the frozen reference policy
(rl/reference.py); `offload = true` keeps it on the CPU between scorings.
"""
from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megatron_vlm.data.media import DEFAULT_LIMITS, MediaLimits
from megatron_vlm.data.messages import Record
from megatron_vlm.parallel.device_cache import empty_device_cache

__all__ = ["ScoredValues", "ModelRewardScorer", "limit_value", "text_only_messages"]

log = logging.getLogger("megatron_vlm")



@contextlib.contextmanager
def on_device(model: torch.nn.Module, device: torch.device, offload: bool) -> Iterator[None]:
    """The scoring model on `device` for the block: with `offload` it lives on the CPU between calls (moved in, then
    back out and the device cache emptied), as the reference model does; without, it stays where it is."""
    if not offload:
        yield
        return
    model.to(device)
    try:
        yield
    finally:
        model.to("cpu")
        empty_device_cache(device)

@dataclass
class ScoredValues:
    """One value per completion with the pool's statuses: "ok", "error" (value 0), "clipped"."""

    values: list[float]
    status: list[str]
    detail: list[str] = field(default_factory=list)


def limit_value(x: float, limit: Optional[float]) -> tuple[float, str, str]:
    """(value, status, detail) of a raw score: NaN is an error (0), +-inf or beyond +-limit is clipped."""
    if math.isnan(x):
        return 0.0, "error", "the model's score is NaN"
    if limit is not None and abs(x) > limit:
        return math.copysign(limit, x), "clipped", f"score {x} beyond +-{limit}"
    if math.isinf(x):
        return 0.0, "error", "the model's score is infinite"
    return x, "ok", ""


def text_only_messages(messages: Sequence[dict]) -> list[dict]:
    """The turns with their image / video items left out (for a reward model or judge that reads text only)."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [it for it in content if it.get("type") == "text"]
        out.append({**m, "content": content})
    return out


def _packs(rendered: list[tuple[int, Any]], batch_size: int) -> Iterator[list[tuple[int, Any]]]:
    """`rendered` (completion index, sample) in order, `batch_size` per packed forward at most, a new pack started
    where a sample's vision tensors cannot join the pack's (Nemotron-VL videos of another tile size: concatenated
    they would fail the forward, and every completion of the pack with it)."""
    from megatron_vlm.data.packing import vision_shape_conflict

    pack: list[tuple[int, Any]] = []
    for item in rendered:
        if pack and (len(pack) >= batch_size or vision_shape_conflict([s for _, s in pack], item[1])):
            yield pack
            pack = []
        pack.append(item)
    if pack:
        yield pack


class ModelRewardScorer:
    """Scores completions with the reward model of one `ModelRewardConfig` (`cfg`). `score(completions,
    prompt_messages)` -> `ScoredValues`; `model` and `processor` may be given (tests), else loaded from `cfg.path`."""

    def __init__(self, cfg: Any, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 value_limit: Optional[float] = None, max_frames: int = 8, fps: float = 2.0,
                 limits: MediaLimits = DEFAULT_LIMITS, model: Any = None, processor: Any = None):
        from megatron_vlm.data.processor import load_processor
        from megatron_vlm.rl.rewards.score_model import load_score_model

        self.cfg, self.device, self.value_limit = cfg, torch.device(device), value_limit
        self.max_frames, self.fps, self.limits = max_frames, fps, limits
        self.offload = bool(cfg.offload) and self.device.type != "cpu"
        self.model = model if model is not None else load_score_model(cfg.path, dtype=dtype, device="cpu")
        self.model.eval().requires_grad_(False)
        self.model.to("cpu" if self.offload else self.device)
        self.processor = processor if processor is not None else load_processor(cfg.path)
        n = self.model.score.out_features
        if cfg.logit_index >= n:
            from megatron_vlm.errors import ConfigError

            raise ConfigError(f"rl.rewards.logit_index: {cfg.logit_index} is not a column of {cfg.path}'s {n} logits")
        if cfg.activation == "softmax" and n < 2:
            from megatron_vlm.errors import ConfigError

            raise ConfigError(f"rl.rewards.activation: 'softmax' of a model with num_labels = {n} is always 1; "
                              "use 'none' or 'sigmoid'")
        self.reads_images = bool(getattr(self.model.backbone, "takes_input", lambda _: False)("pixel_values"))

    def _on_device(self) -> contextlib.AbstractContextManager[None]:
        return on_device(self.model, self.device, self.offload)

    def _render(self, messages: Sequence[dict], completion: str) -> Any:
        from megatron_vlm.data.processing import process_record

        turns = list(messages) if self.reads_images else text_only_messages(messages)
        # an empty completion (the policy ended its turn at once) as a text item: the data pipeline refuses a blank
        # string answer (SFT must not learn to stop at once), but here it is what the reward model has to judge
        content: Any = [{"type": "text", "text": completion}] if not completion.strip() else completion
        record = Record(turns + [{"role": "assistant", "content": content}], "reward_model", -1)
        return process_record(record, self.processor, max_frames=self.max_frames, fps=self.fps, limits=self.limits)

    def _reward(self, logits: torch.Tensor) -> torch.Tensor:
        act, k = self.cfg.activation, self.cfg.logit_index
        if act == "softmax":
            return torch.softmax(logits, dim=-1)[:, k]
        col = logits[:, k]
        return torch.sigmoid(col) if act == "sigmoid" else col

    takes_abandon = True
    """`score` takes `abandon`."""

    @torch.no_grad()
    def score(self, completions: Sequence[str], prompt_messages: Sequence[Sequence[dict]], *,
              abandon: Optional[Callable[[], bool]] = None) -> ScoredValues:
        """Reward of completion i as the answer to the prompt whose messages are `prompt_messages[i]`. `abandon`: the
        stop check, asked between packed forwards: once it has said stop for `ABANDON_GRACE_S`, `WaitAbandoned`
        ("reward models") and no value (a forward already running ends first)."""
        from megatron_vlm.abandon import Patience, WaitAbandoned
        from megatron_vlm.data.packing import collate_pack

        give_up = Patience(abandon) if abandon is not None else None

        n = len(completions)
        out = ScoredValues(values=[0.0] * n, status=["ok"] * n, detail=[""] * n)
        rendered: list[tuple[int, Any]] = []
        for i, (text, msgs) in enumerate(zip(completions, prompt_messages)):
            try:
                sample = self._render(msgs, text)
            except Exception as e:  # noqa: BLE001 - one completion's failure is its own counted 0
                out.status[i], out.detail[i] = "error", f"cannot render: {type(e).__name__}: {e}"
                continue
            if len(sample.input_ids) > self.cfg.max_tokens:
                out.status[i], out.detail[i] = "error", f"{len(sample.input_ids)} tokens > max_tokens {self.cfg.max_tokens}"
                continue
            rendered.append((i, sample))
        with self._on_device():
            done = 0
            for chunk in _packs(rendered, self.cfg.batch_size):
                if give_up is not None and give_up():
                    raise WaitAbandoned(f"reward model {self.cfg.name or self.cfg.path!r} given up after {done} of {len(rendered)} "
                                        "completions: the rank is stopping", waited_for="reward models")
                done += len(chunk)
                try:
                    batch = {k: (v.to(self.device) if torch.is_tensor(v) else v)
                             for k, v in collate_pack([s for _, s in chunk]).items()}
                    rewards = self._reward(self.model(batch)).float().cpu().tolist()
                    if len(rewards) != len(chunk):
                        raise RuntimeError(f"{len(rewards)} scores for {len(chunk)} sequences")
                except Exception as e:  # noqa: BLE001 - a failed forward is a counted 0 for its completions
                    for i, _ in chunk:
                        out.status[i], out.detail[i] = "error", f"forward failed: {type(e).__name__}: {e}"
                    continue
                for (i, _), r in zip(chunk, rewards):
                    out.values[i], out.status[i], out.detail[i] = limit_value(float(r), self.value_limit)
        return out
