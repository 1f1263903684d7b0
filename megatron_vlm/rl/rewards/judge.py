"""`[[rl.rewards]] type = "judge"`: a generative VLM answers a templated question about each completion; the
answer, parsed, is the reward.

The judge's prompt is one user turn: the prompt's images (unless `images = false` or the judge reads text
only) and `template` filled with {question} (the prompt's text), {completion} and {reference} (the dataset's
answer), rendered by the judge folder's chat template through the data pipeline (`PromptEncoder`, as GRPO's
prompts). The filled-in texts are read as written: special-token strings in them ("<|im_end|>", "<|image_pad|>"
typed by the policy, or in the dataset's question / answer) are tokenized as plain text, the template's own text,
turn tokens and the prompt's image placeholders stay special (data/plain_text.py, as a reward model reads the
completion); they made the judge's prompt unusable, a counted 0 whatever was written. A template whose own text holds such a
string is refused when the judge loads (`template_special_refusal`: it would make every judge prompt unusable),
and by `--check` from the judge's tokenizer files. It is decoded greedily by the rollout engine (`PolicyRolloutEngine` on the judge's own weights,
continuous batching over `batch_size` slots, `max_new_tokens` per answer) and parsed (`parse_judgement`):
"yes_no" = 1 for an answer whose first word is yes, 0 for no; "score" = the first number / `max_score`; a judge
that reasons first is parsed on what follows its `</think>` (one cut before it is an error).

Failures are the reward pool's: an answer that parses to nothing, a judge prompt that cannot be encoded
(or is over `max_tokens`), a generate call that raises — each scores 0 and is an "error" (`reward/errors`);
a score outside [0, max_score] is clipped into [0, 1] ("clipped"). `last_answers` keeps the judge's texts
of the latest call (tests, debugging).
"""
from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from megatron_vlm.data.media import DEFAULT_LIMITS, MediaLimits
from megatron_vlm.rl.rewards.model_reward import ScoredValues, check_position_limit, on_device, text_only_messages

__all__ = ["JudgeRewardScorer", "parse_judgement", "judge_messages", "marked_judge_messages", "refused_strings",
           "template_special_refusal"]

log = logging.getLogger("megatron_vlm")

_YES_NO = re.compile(r"^\W*(yes|no)\b", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def parse_judgement(text: str, parse: str, scale: float = 10.0) -> tuple[float, str, str]:
    """(reward, status, detail) of one judge answer (module docstring). A judge that reasons first (Qwen3's thinking
    mode: `<think> ... </think>`, the opening tag written by the model or by its template) is parsed on the text after
    its last `</think>`: its reasoning's words and numbers are not its verdict; one whose reasoning never closed
    (cut by `max_new_tokens`) gave no answer."""
    head, closed, answer = text.rpartition(_THINK_CLOSE)
    if closed:
        text = answer
    elif _THINK_OPEN in text:
        return 0.0, "error", f"judge answer is reasoning that never closed (raise max_new_tokens): {text[:80]!r}"
    if parse == "yes_no":
        m = _YES_NO.match(text)
        if m is None:
            return 0.0, "error", f"judge answer is not yes / no: {text[:80]!r}"
        return (1.0 if m.group(1).lower() == "yes" else 0.0), "ok", ""
    m = _NUMBER.search(text)
    if m is None:
        return 0.0, "error", f"judge answer has no number: {text[:80]!r}"
    x = float(m.group(0)) / scale
    if not 0.0 <= x <= 1.0:
        return min(max(x, 0.0), 1.0), "clipped", f"judge score {m.group(0)} outside [0, {scale:g}]"
    return x, "ok", ""


def refused_strings(proc: Any) -> tuple[str, ...]:
    """The strings a prompt's own text may not hold (the data pipeline's check, `processing._check_text`): the
    placeholders and the structural tokens (turn start / end, EOS, pad, the family's vision boundaries). Other
    special tokens (Qwen's <|box_start|> for grounding) are legitimate text, in a judge's template too."""
    return tuple(proc.special_strings)


def template_special_refusal(template: str, specials: Sequence[str], path: str) -> Optional[str]:
    """Why the judge at `path` cannot read `template`, or None: the template's own text (outside its {fields}) holds
    `specials` (`refused_strings` of the judge's processor). Why refused: the template's text is checked as
    any prompt's text (the filled-in texts are read as plain text, the template's
    own are not), so such a template made every judge prompt unusable, each judgement a counted error scoring 0,
    the whole run long."""
    import string

    literal = [text for text, *_ in string.Formatter().parse(template)]
    found = sorted({s for s in specials if s and any(s in t for t in literal)}, key=lambda t: (-len(t), t))
    if not found:
        return None
    return (f"its text holds {', '.join(repr(t) for t in found)}, a placeholder or turn / end token of the judge "
            f"({path}), which a prompt's text may not hold: every judge prompt would be refused, each judgement an "
            "error scoring 0. Leave turn and image tokens to the judge's chat template (the template is the user "
            "turn's text) and write other text without them")


def judge_messages(template: str, prompt_messages: Sequence[dict], *, question: str, completion: str, reference: str,
                   images: bool) -> list[dict]:
    """The judge's one user turn: the prompt's images (when `images`), then the filled template."""
    text = template.format(question=question, completion=completion, reference=reference)
    return _judge_turn(prompt_messages, text, images)


def marked_judge_messages(template: str, prompt_messages: Sequence[dict], *, question: str, completion: str,
                          reference: str, images: bool) -> tuple[list[dict], list[str]]:
    """`judge_messages` with the filled-in texts as markers, and those texts (`plain_text.marked_format`): the
    encoder reads their special-token strings as plain text (a completion that types "<|im_end|>" is judged on those
    characters), the template's and the images' tokens stay special."""
    from megatron_vlm.data.plain_text import marked_format

    text, texts = marked_format(template, {"question": question, "completion": completion, "reference": reference})
    return _judge_turn(prompt_messages, text, images), texts


def _judge_turn(prompt_messages: Sequence[dict], text: str, images: bool) -> list[dict]:
    items: list[dict] = []
    if images:
        items = [it for m in prompt_messages if isinstance(m["content"], list) for it in m["content"]
                 if it.get("type") in ("image", "video")]
    return [{"role": "user", "content": [*items, {"type": "text", "text": text}]}]


class JudgeRewardScorer:
    """Scores completions with the judge of one `JudgeRewardConfig` (`cfg`). `score(completions, answers,
    questions, prompt_messages)` -> `ScoredValues`; `model` / `processor` may be given (tests)."""

    def __init__(self, cfg: Any, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 max_frames: int = 8, fps: float = 2.0, limits: MediaLimits = DEFAULT_LIMITS,
                 model: Any = None, processor: Any = None):
        from megatron_vlm.checkpoint.hf import load_hf_model
        from megatron_vlm.data.processor import load_processor
        from megatron_vlm.errors import ConfigError
        from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
        from megatron_vlm.rl.prompts.encoder import PromptEncoder

        self.cfg, self.device = cfg, torch.device(device)
        check_position_limit(cfg)  # before loading: a prompt + answer past the judge's positions is no judgement
        self.processor = processor if processor is not None else load_processor(cfg.path)
        refused = template_special_refusal(cfg.template, refused_strings(self.processor), cfg.path)  # before the weights
        if refused:
            raise ConfigError(f"rl.rewards.template: {refused}")
        self.offload = bool(cfg.offload) and self.device.type != "cpu"
        self.model = model if model is not None else load_hf_model(cfg.path, dtype=dtype, device="cpu")
        self.model.eval().requires_grad_(False)
        self.model.to("cpu" if self.offload else self.device)
        self.reads_images = bool(getattr(self.model, "takes_input", lambda _: False)("pixel_values"))
        self.encoder = PromptEncoder(self.processor, max_frames=max_frames, fps=fps, max_new_tokens=cfg.max_new_tokens,
                                     max_tokens=cfg.max_tokens, limits=limits)
        self.engine = PolicyRolloutEngine(self.model, self.processor.tokenizer,
                                          EngineOptions(cache_dtype=dtype, device=self.device, max_num_seqs=cfg.batch_size))
        self.last_answers: list[Optional[str]] = []

    def _on_device(self) -> contextlib.AbstractContextManager[None]:
        return on_device(self.model, self.device, self.offload)

    takes_abandon = True
    """`score` takes `abandon`."""

    def score(self, completions: Sequence[str], answers: Sequence[str], questions: Sequence[str],
              prompt_messages: Sequence[Sequence[dict]], *, abandon: Optional[Callable[[], bool]] = None) -> ScoredValues:
        """Reward of completion i to question i (reference answers[i], prompt turns prompt_messages[i]). `abandon`: the
        stop check, asked by the judge's generation between decode steps (`WaitAbandoned`, "reward models")."""
        from megatron_vlm.abandon import WaitAbandoned
        from megatron_vlm.inference.engine import SamplingParams
        from megatron_vlm.rl.prompts.dataset import PromptSample

        cfg, n = self.cfg, len(completions)
        out = ScoredValues(values=[0.0] * n, status=["ok"] * n, detail=[""] * n)
        self.last_answers = [None] * n
        show_images = cfg.images and self.reads_images
        encoded, where = [], []
        for i in range(n):
            msgs = prompt_messages[i] if show_images else text_only_messages(prompt_messages[i])
            turn, texts = marked_judge_messages(cfg.template, msgs, question=str(questions[i]),
                                                completion=str(completions[i]), reference=str(answers[i]),
                                                images=show_images)
            # the answer of a PromptSample is its dropped assistant turn: never rendered for generation, but not empty
            sample = PromptSample(prompt_id=f"judge:{i}", answer=str(answers[i]) or "-", problem=str(questions[i]),
                                  messages=turn)
            e = self.encoder.encode(sample, literal_texts=texts)  # None: counted by the encoder, logged (first few)
            if e is None:
                out.status[i], out.detail[i] = "error", f"judge prompt not usable: {self.encoder.last_skip}"
                continue
            encoded.append(e)
            where.append(i)
        if not encoded:
            return out
        try:
            with self._on_device():
                wait: dict[str, Any] = ({"abandon": abandon} if abandon is not None
                                        and getattr(self.engine, "takes_abandon", False) else {})
                try:
                    result = self.engine.generate(encoded, SamplingParams(max_new_tokens=cfg.max_new_tokens, n=1,
                                                                          temperature=0.0), **wait)
                except WaitAbandoned as e:
                    self.engine.release_memory()
                    raise WaitAbandoned(f"judge {cfg.name or cfg.path!r}: {e}", waited_for="reward models") from None
                self.engine.release_memory()
        except Exception as e:  # noqa: BLE001 - a failed judge call is a counted 0 for its completions
            for i in where:
                out.status[i], out.detail[i] = "error", f"judge generate failed: {type(e).__name__}: {e}"
            return out
        for i, s in zip(where, result.samples):
            self.last_answers[i] = s.text
            out.values[i], out.status[i], out.detail[i] = parse_judgement(s.text, cfg.parse, cfg.scale())
        return out
