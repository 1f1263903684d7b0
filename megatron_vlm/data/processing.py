"""One record -> model inputs: chat template, images / videos, placeholder expansion, labels mask.

`process_record` does what the family's transformers processor does with
`processor(text=apply_chat_template(messages), images=..., videos=...)` — render the conversation
with the model folder's chat template, preprocess the images and frame-list videos, replace each
placeholder by the family's expansion (runs of feature tokens, start / end tokens, frame labels;
see processor.py), tokenise — and adds the labels mask: True exactly on the tokens of every
assistant turn's content plus the `<|im_end|>` that closes it (the header
`<|im_start|>assistant\\n` and the newline after `<|im_end|>` are not trained). The mask is found
on character offsets of the rendered text, so it holds for any tokenizer: a token is trained when it
overlaps an assistant span, as transformers' `return_assistant_tokens_mask` decides (a token that
joins the header's newline to the answer's leading newline is the answer's first token). Vision tensors of a
record are concatenated per key in the order of their placeholders in the text (InternVL puts
image tiles and video frames into one `pixel_values`).

`estimate_length` gives the exact token count without decoding pixels (image sizes come from file
headers, the expansion from the processor's resize rule; see expansion.py), so packs can be
planned for a whole epoch cheaply.

Per-record problems raise `BadRecordError` (missing / corrupt image, an image or video over the
`[data]` pixel caps, undecodable or too slow video, a placeholder count that does not match the
images or the features, an empty assistant answer).

An assistant turn that is empty or only whitespace is a bad record ("invalid_record"), counted and
skipped like the others: trained, it teaches the model to close its turn at once (its only label
is the end-of-turn token), and a file of them is almost always a conversion bug (a wrong column,
a failed generation) that would otherwise train silently on nothing. For generation (held-out
answer accuracy, benchmarks) an empty reference answer cannot be scored and is refused the same
way. Both are found while planning, from the text alone, so a split of only such records is a
config error before training (`loader.require_usable`).
"""
from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_vlm.data import plain_text
from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.data.batch import VISION_KEYS, SampleInputs
from megatron_vlm.data.expansion import expand, omitted_tokens, placeholder_order, run_counts
from megatron_vlm.data.media import DEFAULT_LIMITS, MediaLimits, VideoClip, image_hw, load_image, read_video, subsample_indices
from megatron_vlm.data.messages import Record
from megatron_vlm.data.processor import VLProcessor, concat_in_order

__all__ = [
    "MediaLimits", "ProcessedSample", "process_record", "estimate_length", "estimate_length_and_class", "pack_class",
    "assistant_char_spans", "prompt_messages",
    "load_image", "image_hw", "read_video", "VideoClip", "subsample_indices",
]



@dataclass
class ProcessedSample(SampleInputs):
    """A record processed for training (or, `for_generation`, a prompt): its model inputs plus the label mask
    and where it came from."""

    label_mask: torch.Tensor = field(kw_only=True)
    """[T] bool: True on trained assistant tokens (not yet shifted)."""
    source: str = ""
    index: int = -1
    answer: Optional[str] = None
    """For generation prompts: the reference answer (the dropped last assistant turn)."""
    meta: dict = field(default_factory=dict)
    """The record's other top-level fields (e.g. "question_type")."""
    images: Optional[list] = None
    """For generation prompts: the loaded RGB images, in order (what an external engine such as vLLM
    processes itself); None for training samples and text-only prompts."""
    videos: Optional[list] = None
    """For generation prompts: the videos' kept frames as loaded (`media.VideoClip`: frames, their source
    indices and rate), in order, for an external engine such as vLLM; None for training samples and prompts
    without video."""


# ---------------------------------------------------------------------- text
def _check_text(record_messages: list[dict], proc: VLProcessor, tools: Optional[list] = None) -> None:
    """Text the template renders from the record (message contents, tool calls, reasoning, tool specs) must not
    contain the processor's special tokens: they would spoof placeholders / turns (a turn end inside reasoning
    closed the trained span early and left the answer after it untrained)."""
    placeholders = [t for t in (proc.image_token, proc.video_token) if t]
    fields = []
    for i, m in enumerate(record_messages):
        texts = [m["content"]] if isinstance(m["content"], str) else [
            it["text"] for it in m["content"] if it["type"] == "text"]
        if m.get("tool_calls"):
            texts.append(json.dumps(m["tool_calls"], ensure_ascii=False))
        if m.get("reasoning_content"):
            texts.append(m["reasoning_content"])
        fields += [(f"messages[{i}]", t) for t in texts]
    if tools:
        fields.append(("tools", json.dumps(tools, ensure_ascii=False)))
    for where, t in fields:
        for s in placeholders:
            if s in t:
                raise BadRecordError("placeholder_mismatch", f"{where} text contains the placeholder {s}")
        for s in proc.special_strings:
            if s in t:
                raise BadRecordError("invalid_record", f"{where} text contains the special token {s}")


def assistant_char_spans(text: str, proc: VLProcessor) -> list[tuple[int, int]]:
    """[start, end) character spans of assistant content + the closing turn-end token."""
    spans, pos = [], 0
    while True:
        i = text.find(proc.assistant_header, pos)
        if i < 0:
            return spans
        start = i + len(proc.assistant_header)
        j = text.find(proc.turn_end, start)
        end = len(text) if j < 0 else j + len(proc.turn_end)
        spans.append((start, end))
        pos = end


def prompt_messages(messages: list[dict]) -> tuple[list[dict], str]:
    """Messages before the last assistant turn, and that turn's text (the reference answer)."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:last], messages[last]["content"]


def _media(messages: list[dict]) -> tuple[list, list[dict]]:
    images = [it["image"] for m in messages if not isinstance(m["content"], str)
              for it in m["content"] if it["type"] == "image"]
    videos = [it for m in messages if not isinstance(m["content"], str) for it in m["content"] if it["type"] == "video"]
    return images, videos


def _add_special_tokens(proc: VLProcessor, text: str) -> bool:
    """Whether the tokenizer adds its special tokens to a rendered conversation: not when the text starts with the
    BOS (the template wrote it; a tokenizer that adds one too would give two), as transformers'
    `apply_chat_template(tokenize=True)` decides."""
    bos = proc.tokenizer.bos_token
    return not (bos and text.startswith(bos))


def _blank(content) -> bool:
    return isinstance(content, str) and not content.strip()


def _rendered(record: Record, proc: VLProcessor, for_generation: bool, literal_answer: bool = False,
              literal_texts: Sequence[str] = ()):
    """(messages, reference answer, rendered text, image refs, video items, placeholder order, pieces): `pieces` is
    None, or with `literal_answer` and special-token strings in the last turn's text (with `literal_texts` and
    special-token strings in them), the rendered text as [(piece, is that text)] (data/plain_text.py)."""
    messages, answer = record.messages, None
    if literal_answer and (for_generation or not messages or messages[-1]["role"] != "assistant"):
        raise ValueError("literal_answer: the record must end with the assistant turn to score")
    if literal_texts and (literal_answer or not for_generation):
        raise ValueError("literal_texts: only for a generation prompt")
    if for_generation:
        messages, answer = prompt_messages(messages)
        if _blank(answer):
            raise BadRecordError("invalid_record", "the last assistant turn (the reference answer) is empty")
    else:
        for i, m in enumerate(messages):
            if m["role"] == "assistant" and _blank(m["content"]) and not m.get("tool_calls"):
                raise BadRecordError("invalid_record", f"messages[{i}]: empty assistant answer (it would train "
                                                       "the model to end its turn at once)")
    marked = None
    if literal_texts:
        marked, messages = messages, plain_text.unmarked_messages(messages, list(literal_texts))
        if not plain_text.has_special(list(literal_texts), (*plain_text.special_strings(proc),
                                                            *filter(None, proc.placeholders.values()))):
            marked = None  # nothing to keep literal: the text is checked and tokenized as any prompt's
    _check_text(marked if marked is not None else messages[:-1] if literal_answer else messages, proc, record.tools)
    text = proc.render(messages, add_generation_prompt=for_generation, tools=record.tools)
    pieces = None
    if marked is not None:
        pieces = plain_text.segments(text, proc.render(marked, add_generation_prompt=True, tools=record.tools),
                                     list(literal_texts))
    elif literal_answer:
        texts = plain_text.message_texts(messages[-1:])
        # a placeholder string that is no added token (InternVL's "<video>") would still be counted as a placeholder
        if plain_text.has_special(texts, (*plain_text.special_strings(proc), *filter(None, proc.placeholders.values()))):
            marked = proc.render([*messages[:-1], *plain_text.marked_messages(messages[-1:])], tools=record.tools)
            pieces = plain_text.segments(text, marked, texts)
    images, videos = _media(messages)
    order = [k for p, lit in (pieces or [(text, False)]) if not lit for k in placeholder_order(p, proc.placeholders)]
    if order.count("image") != len(images) or order.count("video") != len(videos):
        raise BadRecordError("placeholder_mismatch", f"the chat template produced {order.count('image')} image / "
                             f"{order.count('video')} video placeholders for {len(images)} images / "
                             f"{len(videos)} videos")
    return messages, answer, text, images, videos, order, pieces


def estimate_length(record: Record, proc: VLProcessor, *, max_frames: int, for_generation: bool = False,
                    fps: float = 2.0, limits: MediaLimits = DEFAULT_LIMITS) -> int:
    """Exact token count of `process_record(record, ...)` from image headers and video metadata only
    (no pixel decoding). `fps` only matters for families that write timestamps into the text
    (Qwen3-VL, Nemotron-VL). `limits`: pixel caps and decode timeout (media.MediaLimits)."""
    return estimate_length_and_class(record, proc, max_frames=max_frames, for_generation=for_generation, fps=fps,
                                     limits=limits)[0]


def estimate_length_and_class(record: Record, proc: VLProcessor, *, max_frames: int, for_generation: bool = False,
                              fps: float = 2.0, limits: MediaLimits = DEFAULT_LIMITS) -> tuple[int, int]:
    """(`estimate_length`, `pack_class` of the record's videos) from the same headers."""
    _, _, text, images, videos, _, _ = _rendered(record, proc, for_generation)
    cap = limits.max_image_pixels
    clips = [read_video(it, max_frames, fps, decode=False, limits=limits) for it in videos]
    expansions = {"image": proc.image_expansions([image_hw(ref, cap) for ref in images]) if images else [],
                  "video": [proc.video_expansion(clip) for clip in clips]}
    compact = expand(text, proc.placeholders, expansions, compact=True)
    n = len(proc.tokenizer(compact, add_special_tokens=_add_special_tokens(proc, compact))["input_ids"])
    return (n + sum(omitted_tokens(e) for items in expansions.values() for e in items),
            pack_class([proc.video_frame_shape(clip) for clip in clips]))


def pack_class(shapes: Sequence[Optional[tuple[int, ...]]]) -> int:
    """0 when a record's vision tensors join any pack (no video whose tensor shape depends on the video:
    `VLProcessor.video_frame_shape`), else a positive int naming its shapes: records of two different classes
    cannot share a pack (their videos would not concatenate), and the planner keeps them apart (plan.py)."""
    kinds = sorted({tuple(int(d) for d in s) for s in shapes if s is not None})
    return zlib.crc32(repr(kinds).encode()) + 1 if kinds else 0


def process_record(record: Record, proc: VLProcessor, *, max_frames: int, fps: float = 2.0,
                   for_generation: bool = False, limits: MediaLimits = DEFAULT_LIMITS,
                   literal_answer: bool = False, literal_texts: Sequence[str] = ()) -> ProcessedSample:
    """Tokens, labels mask and vision tensors of one record (see module docstring).

    for_generation: drop the last assistant turn, end with the generation prompt, no labels; the
    dropped text is returned as `answer`. `limits`: pixel caps and decode timeout (media.MediaLimits).
    literal_answer: the last turn is a policy's completion to score (a reward model's input): special-token
    strings in its text are tokenized as plain characters (data/plain_text.py) instead of refusing the record;
    the template's own special tokens stay special. ValueError when the template does not write that text as given.
    literal_texts (with for_generation): untrusted texts inside the record's text items (a judge's prompt: the
    completion it judges), each written there as its marker (`plain_text.marked_format`): filled in and, where they
    hold special-token strings, tokenized as plain characters as literal_answer's text is."""
    messages, answer, text, images, videos, order, pieces = _rendered(record, proc, for_generation, literal_answer,
                                                                      literal_texts)
    cap = limits.max_image_pixels
    loaded = [load_image(ref, cap) for ref in images]
    clips = [read_video(it, max_frames, fps, limits=limits) for it in videos]
    items = {"image": proc.process_images(loaded) if images else [],
             "video": [proc.process_video(clip) for clip in clips]}
    out = ProcessedSample(input_ids=torch.empty(0, dtype=torch.long), label_mask=torch.empty(0, dtype=torch.bool),
                          source=record.source, index=record.index, answer=answer, meta=record.meta,
                          images=loaded if (for_generation and loaded) else None,
                          videos=clips if (for_generation and clips) else None)
    for key, value in concat_in_order(order, items).items():
        if key not in VISION_KEYS:
            raise ValueError(f"{type(proc).__name__} returned an unknown model input {key!r}")
        setattr(out, key, value)
    expansions = {k: [it.expansion for it in v] for k, v in items.items()}
    if pieces is None:
        text = expand(text, proc.placeholders, expansions)
        enc = proc.tokenizer(text, return_offsets_mapping=True, add_special_tokens=_add_special_tokens(proc, text))
        id_list, offset_list = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    else:
        pieces = _expanded_pieces(pieces, proc, expansions)
        text = "".join(p for p, _ in pieces)
        id_list, offset_list = plain_text.tokenize_with_offsets(proc.tokenizer, pieces, plain_text.special_strings(proc),
                                                                proc.tokenizer.convert_tokens_to_ids)
        if _add_special_tokens(proc, text):
            id_list, offset_list = _with_added_tokens(proc, id_list, offset_list)
    ids = torch.tensor(id_list, dtype=torch.long)
    for token, expected in run_counts([e for v in expansions.values() for e in v]).items():
        found = int((ids == proc.tokenizer.convert_tokens_to_ids(token)).sum())
        if found != expected:
            raise BadRecordError("placeholder_mismatch", f"{found} {token} tokens vs {expected} vision features")
    mask = torch.zeros(ids.numel(), dtype=torch.bool)
    if not for_generation:
        spans = assistant_char_spans(text, proc) if pieces is None else _literal_spans(pieces, proc)
        n_assistant = sum(m["role"] == "assistant" for m in messages)
        if len(spans) != n_assistant:
            raise BadRecordError("invalid_record", f"found {len(spans)} assistant turns in the rendered text, "
                                                   f"expected {n_assistant} (chat template / turn markers)")
        # every token overlapping a span (transformers' assistant_masks rule): a token that begins in the
        # header but ends inside the answer (Qwen2's regex keeps "\n\n..." in one piece) is the answer's first
        offsets = torch.tensor(offset_list, dtype=torch.long).reshape(-1, 2)
        starts, ends = offsets[:, 0], offsets[:, 1]
        for a, b in spans:
            mask |= (ends > a) & (starts < b)
    out.input_ids, out.label_mask = ids, mask
    return out


def _expanded_pieces(pieces: list[tuple[str, bool]], proc: VLProcessor,
                     expansions: dict[str, list]) -> list[tuple[str, bool]]:
    """The template's pieces with their placeholders expanded (each piece takes the next expansions of each kind);
    the literal text as it is."""
    left = {k: list(v) for k, v in expansions.items()}
    out = []
    for p, lit in pieces:
        if not lit:
            kinds = placeholder_order(p, proc.placeholders)
            mine = {k: v[:kinds.count(k)] for k, v in left.items()}
            left = {k: v[kinds.count(k):] for k, v in left.items()}
            p = expand(p, proc.placeholders, mine)
        out.append((p, lit))
    return out


def _literal_spans(pieces: list[tuple[str, bool]], proc: VLProcessor) -> list[tuple[int, int]]:
    """`assistant_char_spans` of a rendering whose last assistant turn is the literal piece (its text may hold the
    turn markers themselves): the earlier turns' spans, then the literal text with the turn end that closes it."""
    start = 0
    for p, lit in pieces:
        if lit:
            break
        start += len(p)
    text = "".join(p for p, _ in pieces)
    end = start + len(next(p for p, lit in pieces if lit))
    spans = [(a, b) for a, b in assistant_char_spans(text[:start], proc) if b > a]
    return [*spans, (start, end + len(proc.turn_end) if text.startswith(proc.turn_end, end) else end)]


def _with_added_tokens(proc: VLProcessor, ids: list[int],
                       offsets: list[tuple[int, int]]) -> tuple[list[int], list[tuple[int, int]]]:
    """`ids` with the special tokens the tokenizer adds around a text (a BOS), as a call with `add_special_tokens`
    would have them (none for Qwen's tokenizers)."""
    bare = proc.tokenizer("a", add_special_tokens=False)["input_ids"]
    full = proc.tokenizer("a", add_special_tokens=True)["input_ids"]
    k = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
    if k is None:
        return ids, offsets
    before, after = list(full[:k]), list(full[k + len(bare):])
    return before + ids + after, [(0, 0)] * len(before) + offsets + [(0, 0)] * len(after)
