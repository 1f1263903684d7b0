"""`[[rl.rewards]] type = "model"`: a learned reward model scores each completion, in batches, in the training process.

Each completion becomes a conversation — the prompt's messages (its images too when the reward model reads
images; a text-only reward model gets the text of the turns) and the completion as the assistant turn —
rendered and tokenised by the reward model folder's own processor (the data pipeline's `process_record`,
as SFT), packed `batch_size` at a time and scored by `SequenceScoreModel` (score_model.py): the logit of
the last token, through `activation`.

What the policy wrote is scored as written, so that no way of writing earns a value the model did not give:
- special-token strings in the completion's text ("<|im_end|>", "<|image_pad|>" typed as characters) are
  tokenized as plain text, the template's own special tokens stay special (data/plain_text.py); they were a
  refused record, a fixed value the policy could reach by typing them.
- a prompt + completion over `max_tokens` is scored truncated: the prompt, the completion's first tokens and the
  template's turn close (`<|im_end|>\\n`), so the score is read at the token the model reads a whole turn at;
  counted (`ScoredValues.truncated`, `reward/truncated`). verl's reward model worker truncates the same way (its
  `truncation = "right"` default keeps the first `max_length` tokens, and reads the last kept one); TRL's GRPO
  scores the whole text (no limit). A fixed value here paid the policy for running long (with `activation =
  "none"` a 0 is above every negative score). `max_tokens` itself is refused above the folder's
  `max_position_embeddings` (`position_limit_refusal`): positions the model never read score garbage.

Why in-process and not in the reward worker pool: the pool's workers hold no torch and run one call per
process; a network wants batches on the device. The pool's guarantees hold here too, per completion
(`ScoredValues.status`): a completion that cannot be scored (a missing image, a prompt that alone fills
`max_tokens`, a template that rewrites the completion's text, a batch whose forward raises, a NaN score) is an
"error" (the run goes on; `reward/errors` counts it and `rl.reward_pool.max_failed_steps` stops a run whose
every call fails) with the failure value (`failure_value`, by default one that never ranks it above a scored
completion: `failure_value_of`); an infinite or larger-than-`rl.reward_pool.abs_max` score is clipped to +-abs_max
("clipped"). An empty completion (the policy ended its turn at once) is scored like any other, on the prompt and
an empty assistant turn: a fixed 0 would rank it above every answer the model scores below 0, a reward for
answering nothing.

Placement: one full copy per rank, in the run's compute dtype, as the frozen reference policy
(rl/reference.py); `offload = true` keeps it on the CPU between scorings.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_vlm.data.media import DEFAULT_LIMITS, MediaLimits
from megatron_vlm.data.messages import Record
from megatron_vlm.parallel.device_cache import empty_device_cache

__all__ = ["ScoredValues", "ModelRewardScorer", "failure_value_of", "limit_value", "position_limit_refusal",
           "text_only_messages", "truncated_sample"]

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
    """One value per completion with the pool's statuses: "ok", "error" (the failure value), "clipped"."""

    values: list[float]
    status: list[str]
    detail: list[str] = field(default_factory=list)
    truncated: int = 0
    """Completions scored on their first tokens (over the reward model's `max_tokens`)."""


def failure_value_of(cfg: Any, values: Sequence[float], status: Sequence[str]) -> float:
    """The value of a completion the reward model could not score: `cfg.failure_value` when set; else 0 with
    "sigmoid" / "softmax" (the bottom of their range) and, with "none" (scores of either sign, where a fixed 0
    would be above every negative score and a policy would learn to fail), the lowest value scored in the same
    call, 0 when none was."""
    if getattr(cfg, "failure_value", None) is not None:
        return float(cfg.failure_value)
    if getattr(cfg, "activation", "none") != "none":
        return 0.0
    scored = [v for v, st in zip(values, status) if st != "error"]
    return min(scored) if scored else 0.0


def position_limit_refusal(hf_config: dict, max_tokens: int, path: Any) -> Optional[str]:
    """Why `max_tokens` does not fit the scoring model `path` (config.json `hf_config`), None when it does: above its
    `max_position_embeddings` (a VLM's text model's: `text_config` / `llm_config`) the tokens sit at positions the
    model was never trained for and its scores are garbage, silently. vLLM refuses a `max_model_len` above the
    same limit; the run refuses it at start and `--check` too (plan/side_models.py). None when the config names no
    limit."""
    limit = None
    for key in ("text_config", "llm_config"):
        sub = hf_config.get(key)
        if isinstance(sub, dict) and sub.get("max_position_embeddings") is not None:
            limit, where = int(sub["max_position_embeddings"]), f"{key}.max_position_embeddings"
            break
    else:
        if hf_config.get("max_position_embeddings") is not None:
            limit, where = int(hf_config["max_position_embeddings"]), "max_position_embeddings"
    if limit is None or max_tokens <= limit:
        return None
    return (f"{max_tokens} is above {path}'s {where} = {limit} (config.json): tokens past it would be read at "
            f"positions the model was never trained for; set it to at most {limit}")


def truncated_sample(sample: Any, max_tokens: int) -> Any:
    """`sample` (a rendered prompt + completion, `process_record`) cut to `max_tokens`: the tokens before the
    completion, its first tokens, and the template's closing tokens from the turn end on (the last labelled token:
    the turn end the label mask ends with); ValueError when the tokens before the completion leave no room for one
    of its tokens (truncating into the prompt would score the same for every completion)."""
    ids, mask = sample.input_ids, sample.label_mask
    marked = torch.nonzero(mask).flatten()
    if marked.numel() == 0:
        raise ValueError("no assistant turn found in the rendered conversation")
    end = int(marked[-1])
    start = end
    while start > 0 and bool(mask[start - 1]):
        start -= 1
    keep = max_tokens - (ids.numel() - end)
    if keep <= start:
        raise ValueError(f"the prompt alone is {start} tokens (+ {ids.numel() - end} to close the turn): max_tokens "
                         f"{max_tokens} leaves no room for the completion ({ids.numel()} tokens in all)")
    idx = torch.cat([torch.arange(keep), torch.arange(end, ids.numel())])
    return replace(sample, input_ids=ids[idx], label_mask=mask[idx])


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


def check_position_limit(cfg: Any) -> None:
    """ConfigError naming `rl.rewards.max_tokens` when it is above the model folder's positions
    (`position_limit_refusal`); a folder without config.json is left to the loader's own refusal."""
    config = Path(cfg.path) / "config.json"
    if not config.is_file():
        return
    refused = position_limit_refusal(json.loads(config.read_text()), cfg.max_tokens, cfg.path)
    if refused:
        from megatron_vlm.errors import ConfigError

        raise ConfigError(f"rl.rewards.max_tokens: {refused}")


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
        check_position_limit(cfg)
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
        return process_record(record, self.processor, max_frames=self.max_frames, fps=self.fps, limits=self.limits,
                              literal_answer=True)

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
                try:
                    sample = truncated_sample(sample, self.cfg.max_tokens)
                except ValueError as e:
                    out.status[i], out.detail[i] = "error", str(e)
                    continue
                out.truncated += 1
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
        failed = failure_value_of(self.cfg, out.values, out.status)
        out.values = [failed if st == "error" else v for v, st in zip(out.values, out.status)]
        return out
