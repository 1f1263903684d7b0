"""An environment's observation -> the tokens appended to the conversation, through the chat template.

Why by difference of renderings: the tokens a turn adds are exactly what the family's chat template writes
for it, so a trajectory is the conversation the model would see if it were rendered whole (the format the
model was trained on). With the conversation so far H (ending with the model's turn, as decoded text):

    before = render(H without the model's turn, generation prompt)     ... <|im_start|>assistant\\n
    after  = render(H + observation turns, generation prompt)          ... <model text><|im_end|>\\n ... <|im_start|>assistant\\n

`after` must start with `before` followed by the model's text; the appended text is the rest of `after` (minus
the end-of-turn token when the model generated it, as its EOS). Why not `render(H)`: a template may write the
last message apart (Qwen3 gives a last assistant turn an empty think block, which the turn loses once a reply
follows it), and what the model is shown next is the turn followed by the reply. The placeholders of the
appended text are expanded by the family's processor and the new images preprocessed (their tensors go through
the vision tower when the chunk is prefilled). A template that rewrites earlier turns (e.g. drops past
reasoning, or writes the model's text otherwise than it was generated) is refused with a clear error rather
than trained on a history the model never saw.

Tools: the specs are written into the system turn as the model's chat template writes them for `tools=`
(`template_tools_text`: Qwen3, Qwen3-VL), else in the Qwen2.5 / Qwen3 tool format (`tools_system_text`), so the
prompt is also right for templates that do not render tools themselves (Qwen2.5-VL's, the tiny test templates).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

import numpy as np
import torch

from megatron_vlm.data import plain_text
from megatron_vlm.data.expansion import expand, placeholder_order
from megatron_vlm.data.media import VideoClip
from megatron_vlm.data.processor_base import concat_in_order
from megatron_vlm.inference.multiturn import TurnChunk
from megatron_vlm.rl.env.base import Observation

__all__ = ["TurnEncoder", "tools_system_text", "template_tools_text", "with_tools", "cut_observation"]

_DEFAULT_SYSTEM = "You are a helpful assistant."


def tools_system_text(tools: list[dict], system: Optional[str] = None) -> str:
    """The system turn's text with the tool specs, in the Qwen2.5 / Qwen3 format."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ((system or _DEFAULT_SYSTEM) + "\n\n# Tools\n\nYou may call one or more functions to assist with the user "
            "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")


def _system_text(content: Any) -> Optional[str]:
    """The text of a system turn: a string, or a list of text parts joined as the chat templates write them (one
    after the other); None for content with other parts (an image), which stays a turn of its own."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(it, dict) and it.get("type") == "text" and isinstance(it.get("text"), str)
                                         for it in content):
        return "".join(it["text"] for it in content)
    return None


def template_tools_text(proc: Any, messages: list[dict], tools: list[dict]) -> Optional[str]:
    """The system turn's text the processor's own chat template writes for `messages` with `tools=` (Qwen3's,
    Qwen3-VL's: the specs and, unlike `tools_system_text`, no default system line), or None for a template that
    renders no tools or whose tools are not one system turn at the start that a plain system message reproduces."""
    head = "<|im_start|>system\n"
    try:
        with_specs = proc.render(messages, tools=tools, strict=False)
        if with_specs == proc.render(messages, strict=False) or not with_specs.startswith(head):
            return None
        end = with_specs.find(proc.turn_end, len(head))
        text = with_specs[len(head):end] if end >= 0 else None
        rest = messages[1:] if messages and messages[0]["role"] == "system" else messages
        if text is None or proc.render([{"role": "system", "content": text}, *rest], strict=False) != with_specs:
            return None
    except Exception:  # noqa: BLE001 - a template that cannot render this: the Qwen text below
        return None
    return text


def with_tools(messages: list[dict], tools: list[dict], proc: Any = None) -> list[dict]:
    """`messages` with the tool specs in the system turn (added when there is none): as `proc`'s chat template writes
    them for `tools=` when it does (`template_tools_text`), else in the Qwen2.5 / Qwen3 format (`tools_system_text`)."""
    if not tools:
        return messages
    own = template_tools_text(proc, messages, tools) if proc is not None else None
    if own is not None:
        rest = messages[1:] if messages and messages[0]["role"] == "system" else messages
        return [{"role": "system", "content": own}, *rest]
    if messages and messages[0]["role"] == "system" and (text := _system_text(messages[0]["content"])) is not None:
        return [{"role": "system", "content": tools_system_text(tools, text)}, *messages[1:]]
    return [{"role": "system", "content": tools_system_text(tools)}, *messages]


def _pil(image: Any):
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    arr = np.asarray(image)
    if arr.ndim != 3 or arr.shape[2] != 3 or arr.dtype != np.uint8:
        raise ValueError(f"an observation image must be a PIL image or an HxWx3 uint8 array, got {arr.dtype} {arr.shape}")
    return Image.fromarray(arr)


def cut_observation(obs: Observation, max_chars: int) -> tuple[Observation, bool]:
    """`obs` with its texts cut to `max_chars` characters in all (in order; images and turns kept), and whether
    anything was cut. Why: an environment's output of many megabytes is cut before it is rendered and tokenized
    (session.py), not tokenized whole only to be refused by the token budget."""
    parts = obs.parts if obs.parts is not None else [{"text": obs.text}]
    texts: list[str] = [t if isinstance(t := p.get("text"), str) else "" for p in parts]
    if sum(len(t) for t in texts) <= max_chars:
        return obs, False
    left, kept = max(0, max_chars), list[str]()
    for t in texts:
        kept.append(t[:left])
        left -= len(kept[-1])
    if obs.parts is None:
        return dataclasses.replace(obs, text=kept[0]), True
    cut = [{**p, "text": k} if isinstance(p.get("text"), str) else p for p, k in zip(obs.parts, kept)]
    return dataclasses.replace(obs, parts=cut), True


def observation_messages(obs: Observation) -> list[dict]:
    """The chat turns of an observation: one per part (each with its share of the images, placed before its
    text), or one turn of `obs.role` with all images then the text."""
    parts: list[dict[str, Any]] = (obs.parts if obs.parts is not None else
                                   [{"role": obs.role, "text": obs.text, "images": len(obs.images),
                                     "videos": len(obs.videos)}])
    for kind, held in (("images", obs.images), ("videos", obs.videos)):
        placed = sum(int(p.get(kind, 0)) for p in parts)
        if placed != len(held):  # more would run out of them half-way (a bare StopIteration), fewer leave some out
            raise ValueError(f"the observation's parts place {placed} {kind} for {len(held)} (their '{kind}' counts "
                             f"must add up to the observation's {kind})")
    images, videos = iter(obs.images), iter(obs.videos)
    out = []
    for p in parts:
        items: list[dict] = [{"type": "image", "image": next(images)} for _ in range(int(p.get("images", 0)))]
        items += [{"type": "video", "video": next(videos)} for _ in range(int(p.get("videos", 0)))]
        if p.get("text"):
            items.append({"type": "text", "text": p["text"]})
        has_media = any(it["type"] != "text" for it in items)
        out.append({"role": p.get("role", obs.role), "content": items if has_media else p.get("text", "")})
    return out


def _clip(frames: Any, fps: float) -> VideoClip:
    """A video of the observation as the processor takes it; one the worker subsampled (observation_limits.py) keeps
    its frames' indices in the source, and so its timestamps."""
    if isinstance(frames, VideoClip):
        pil = [_pil(f) for f in frames.frames or []]
        if not pil:
            raise ValueError("a video observation has no frames")
        w, h = pil[0].size
        return dataclasses.replace(frames, height=h, width=w, frames=pil)
    pil = [_pil(f) for f in frames]
    if not pil:
        raise ValueError("a video observation has no frames")
    w, h = pil[0].size
    return VideoClip(indices=list(range(len(pil))), total_frames=len(pil), fps=float(fps), height=h, width=w, frames=pil)


class TurnEncoder:
    """`encode(history, turn_text, ended_with_eos, observation) -> (TurnChunk, new history)` for one processor."""

    def __init__(self, processor):
        self.proc = processor
        self.specials = plain_text.special_strings(processor)
        """What the tokenizer would read as special tokens in the environment's text (plain_text.py)."""
        self._max_chars: Optional[int] = None

    @property
    def max_chars_per_token(self) -> int:
        """A bound on the characters of text one token covers: the longest vocabulary entry (a byte-level entry has a
        character per byte, and a character is at least a byte) times 4 when the tokenizer normalizes (NFC composes
        up to 4 code points into one). Text of more than (n + 1) x this many characters is more than n tokens."""
        if self._max_chars is None:
            tok = self.proc.tokenizer
            longest = max((len(t) for t in tok.get_vocab()), default=1)
            backend = getattr(tok, "backend_tokenizer", None)
            self._max_chars = max(1, longest) * (1 if backend is not None and backend.normalizer is None else 4)
        return self._max_chars

    @property
    def turn_end_id(self) -> int:
        """The token id of the template's end-of-turn text (`<|im_end|>`): a model turn whose last token is this one
        closed its chat turn itself; one that ended on another EOS id (`<|endoftext|>`) did not."""
        return int(self.proc.tokenizer.convert_tokens_to_ids(self.proc.turn_end))

    def encode(self, history: list[dict], turn_text: str, ended_with_eos: bool,
               obs: Observation) -> tuple[TurnChunk, list[dict]]:
        proc = self.proc
        turn = {"role": "assistant", "content": turn_text}
        new = observation_messages(obs)
        before = proc.render(history, add_generation_prompt=True)
        after = proc.render([*history, turn, *new], add_generation_prompt=True)
        start = len(before) + len(turn_text)  # the model's turn as written with the reply after it (module docstring)
        if not (after.startswith(before) and after[len(before):start] == turn_text):
            raise ValueError("the chat template does not render the conversation turn by turn (an earlier turn's text "
                             "changes when a turn is added): multi-turn rollouts need a template that appends")
        texts = plain_text.message_texts(new)
        if plain_text.has_special(texts, self.specials):  # untrusted text with special-token strings: plain_text.py
            marked = proc.render([*history, turn, *plain_text.marked_messages(new)], add_generation_prompt=True)
            if marked[:start] != after[:start]:
                raise ValueError("the chat template renders the conversation differently around marked texts")
            pieces = plain_text.segments(after[start:], marked[start:], texts)
        else:
            pieces = [(after[start:], False)]
        if ended_with_eos and pieces and not pieces[0][1] and pieces[0][0].startswith(proc.turn_end):
            # the model generated it (its last token is `turn_end_id`)
            pieces = [(pieces[0][0][len(proc.turn_end):], False), *pieces[1:]]
            pieces = [p for p in pieces if p[0]]
        media = [it for m in new if isinstance(m["content"], list) for it in m["content"] if it["type"] != "text"]
        images = [_pil(it["image"]) for it in media if it["type"] == "image"]
        videos = [_clip(it["video"], obs.video_fps) for it in media if it["type"] == "video"]
        order = [k for p, env in pieces if not env for k in placeholder_order(p, proc.placeholders)]
        if order.count("image") != len(images) or order.count("video") != len(videos):
            raise ValueError(f"the chat template wrote {order.count('image')} image / {order.count('video')} video "
                             f"placeholders for {len(images)} images / {len(videos)} videos")
        items = {"image": proc.process_images(images) if images else [],
                 "video": [proc.process_video(c) for c in videos]}
        vision = concat_in_order(order, items)
        pieces = self._expanded(pieces, items)
        if len(pieces) == 1:  # the whole text is the template's: tokenized as one text, as the prompt is
            # mid-conversation: no special tokens of the tokenizer's own (a BOS-adding one put one at every turn)
            ids = proc.tokenizer(pieces[0][0], add_special_tokens=False)["input_ids"]
        else:
            ids = plain_text.tokenize(proc.tokenizer, pieces, self.specials, proc.tokenizer.convert_tokens_to_ids)
        return TurnChunk(torch.tensor(ids, dtype=torch.long), vision, images, videos), [*history, turn, *new]

    def _expanded(self, pieces: list[tuple[str, bool]], items: dict[str, list]) -> list[tuple[str, bool]]:
        """The template's pieces with their placeholders expanded (each takes the next items of each kind)."""
        left = {k: [it.expansion for it in v] for k, v in items.items()}
        out = []
        for p, env in pieces:
            if not env:
                kinds = placeholder_order(p, self.proc.placeholders)
                mine = {k: v[:kinds.count(k)] for k, v in left.items()}
                left = {k: v[kinds.count(k):] for k, v in left.items()}
                p = expand(p, self.proc.placeholders, mine)
            out.append((p, env))
        return out
