"""What every family processor shares: `VLProcessor` (the hooks the per-record pipeline calls),
`VisionItem`, and the folder readers (`read_json`, `folder_chat_template`, `special_token_id`).

The family processors (`processor_qwen_vl`, `processor_internvl`, `processor_nemotron_vl`,
`processor_text`) subclass `VLProcessor` from here; `processor.py` picks one of them for a model
folder (`load_processor`). Keeping the base below both is what lets `processor.py` import the
families at module level without an import cycle."""
from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.data.expansion import Expansion, expand, placeholder_order, run_counts

__all__ = ["VLProcessor", "VisionItem", "read_json", "folder_chat_template", "FolderProcessorDicts",
           "folder_processor_dicts", "special_token_id", "concat_in_order"]


_TOKENIZER_KWARGS = ("truncation", "max_length", "pad_to_multiple_of", "add_special_tokens")
"""Options of the processor call that go to the tokenizer (others are ignored, as before)."""


def _kind(item: dict) -> str:
    t = item.get("type")
    if t in ("image", "video", "text"):
        return t
    if t == "image_url" or "image" in item or "image_url" in item:
        return "image"
    return "video" if "video" in item else "text"


@dataclass
class VisionItem:
    """One processed image or video: its model-input tensors and its placeholder expansion."""

    tensors: dict[str, torch.Tensor]
    """Keys among pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw, second_per_grid_ts;
    a record's items are concatenated per key in the order of their placeholders."""
    expansion: Expansion


def special_token_id(tokenizer, token: str, name_or_path: str = "") -> int:
    """The id of `token`, which must be an added (special) token of the tokenizer: placeholder runs
    rely on every copy being split out as one id (expansion.py)."""
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or (tokenizer.unk_token_id is not None and tid == tokenizer.unk_token_id) \
            or token not in tokenizer.get_added_vocab():
        raise ValueError(f"{name_or_path or 'tokenizer'}: special token {token} is not in the vocabulary")
    return int(tid)


def template_variables(chat_template: str) -> Optional[set[str]]:
    """The variables a chat template reads (its undeclared names, as transformers compiles it); None when it cannot
    be parsed here (then nothing is checked)."""
    try:
        import jinja2.meta
        from transformers.utils.chat_template_utils import _compile_jinja_template

        env = _compile_jinja_template(chat_template).environment
        return set(jinja2.meta.find_undeclared_variables(env.parse(chat_template)))
    except Exception:  # a private helper of transformers, or a template its environment cannot parse
        return None


def template_kwargs_refusal(chat_template: str, kwargs: dict, where: str) -> Optional[str]:
    """Why data.chat_template_kwargs cannot be used with `chat_template` (a name it never reads; None: fine or
    not known), as one line naming the key."""
    reads = template_variables(chat_template)
    unread = sorted(set(kwargs) - reads) if reads is not None else []
    if not unread:
        return None
    return (f"data.chat_template_kwargs.{unread[0]}: the chat template of {where} never reads {unread[0]!r}, so it "
            "would change nothing; remove it")


def folder_template_text(folder: Path) -> Optional[str]:
    """The chat template a model folder ships, read from its files without loading the tokenizer (`--check`):
    chat_template.jinja, chat_template.json, or tokenizer_config.json's (a string, or the "default" of a list of
    named templates); None when it has none of them."""
    return _template_file_text(folder, ("chat_template.json", "tokenizer_config.json"))


def _template_file_text(folder: Path, json_files: tuple[str, ...]) -> Optional[str]:
    """chat_template.jinja, else the "chat_template" of the first of `json_files` that has one (a string, or the
    "default" of a list of named templates)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    for name in json_files:
        if (folder / name).is_file():
            tpl = read_json(folder / name).get("chat_template")
            if isinstance(tpl, list):
                tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
            if isinstance(tpl, str) and tpl:
                return tpl
    return None


class VLProcessor:
    """Tokenizer + chat template + a family's vision hooks (module docstring). Not used directly."""

    family = ""
    # ChatML turn markers: what the labels mask looks for in the rendered conversation.
    assistant_header = "<|im_start|>assistant\n"
    turn_end = "<|im_end|>"
    returns_mm_token_type_ids = False
    """Whether the family's transformers processor returns mm_token_type_ids (Qwen's M-RoPE needs it)."""

    def __init__(self, tokenizer, *, chat_template: str, image_token: Optional[str], video_token: Optional[str],
                 image_token_id: Optional[int], video_token_id: Optional[int], structural_tokens: Sequence[str] = (),
                 name_or_path: str = ""):
        """image_token / video_token: the placeholders the chat template writes (one per item);
        image_token_id / video_token_id: the ids of the tokens the model fills with image / video
        features (video_token_id None when videos use the image token); structural_tokens: further
        special tokens that must not appear in user text. image_token / image_token_id None: a
        text-only processor (processor_text.py)."""
        self.name_or_path = str(name_or_path)
        if not chat_template:
            raise ValueError(f"{self.name_or_path or 'processor'}: no chat template (chat_template.jinja / "
                             "chat_template.json / tokenizer_config.json)")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_kwargs: dict[str, Any] = {}
        """data.chat_template_kwargs: extra template variables of every rendering (`with_template_kwargs`)."""
        self.image_token = image_token
        self.video_token = video_token
        self.image_token_id = None if image_token_id is None else int(image_token_id)
        self.video_token_id = None if video_token_id is None else int(video_token_id)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        # Structural tokens user text must not contain (they would fake placeholders or turns);
        # other special tokens (e.g. Qwen's <|box_start|> for grounding) are legitimate text.
        self.special_strings = tuple(dict.fromkeys(t for t in (
            image_token, video_token, *structural_tokens, "<|im_start|>", self.turn_end, tokenizer.eos_token,
            tokenizer.pad_token) if t))

    def token_id(self, token: str) -> int:
        return special_token_id(self.tokenizer, token, self.name_or_path)

    @property
    def placeholders(self) -> dict[str, Optional[str]]:
        return {"image": self.image_token, "video": self.video_token}

    # ------------------------------------------------------------------ family hooks
    def process_images(self, images: list) -> list[VisionItem]:
        """RGB PIL images of one record (or one processor call), in order -> one item per image."""
        raise NotImplementedError

    def process_video(self, clip) -> VisionItem:
        """A decoded `media.VideoClip` -> its item."""
        raise NotImplementedError

    def image_expansions(self, sizes: list[tuple[int, int]]) -> list[Expansion]:
        """The expansions `process_images` gives for images of these (height, width), from sizes alone."""
        raise NotImplementedError

    def video_expansion(self, clip) -> Expansion:
        """The expansion `process_video` gives for this clip, from its shape and timing alone."""
        raise NotImplementedError

    def video_frame_shape(self, clip) -> Optional[tuple[int, ...]]:
        """The trailing dims of the clip's video tensor when they depend on the clip (from its shape alone), else None.
        Why: a pack concatenates vision tensors along dim 0, so videos of two such shapes cannot share a pack, and
        the planner keeps them apart (`data.lengths`: pack classes). None here: flattened patches join any pack."""
        return None

    def with_overrides(self, *, min_pixels: Optional[int] = None, max_pixels: Optional[int] = None,
                       video_min_pixels: Optional[int] = None, video_max_pixels: Optional[int] = None) -> VLProcessor:
        """A copy with the [data] section's pixel limits applied (None keeps the folder's value)."""
        given = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels),
                                   ("video_min_pixels", video_min_pixels), ("video_max_pixels", video_max_pixels))
                 if v is not None}
        if given:
            raise ValueError(f"data.{next(iter(given))}: pixel limits do not apply to {self.family or 'this'} "
                             f"processors ({self.name_or_path}); set the image size in the folder's "
                             "preprocessor_config.json instead")
        return self

    def with_template_kwargs(self, kwargs: dict[str, Any]) -> VLProcessor:
        """A copy whose renderings pass `kwargs` (data.chat_template_kwargs) to the chat template. ConfigError (exit 2)
        naming the key for a name the template never reads: it would change nothing (a misspelt `enable_thinking`)."""
        if not kwargs:
            return self
        refused = template_kwargs_refusal(self.chat_template, kwargs, self.name_or_path or "the model")
        if refused:
            from megatron_vlm.errors import ConfigError

            raise ConfigError(refused)
        out = copy.copy(self)
        out.template_kwargs = dict(kwargs)
        return out

    def identity(self) -> dict:
        """Settings that change token counts (part of the length-cache key)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ text
    def _template(self, conversation: list[dict], tools: Optional[list], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(conversation, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, tools=tools or None,
                                                  **self.template_kwargs)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False,
               tools: Optional[list] = None, strict: bool = True) -> str:
        """The conversation as text through the folder's chat template (placeholders unexpanded).

        An assistant message's "tool_calls" and the `tools` specs go to the template as transformers'
        `apply_chat_template` passes them. A template that does not render them, the calls or the specs (the
        text is the same without them: Qwen2.5-VL's knows no tools), raises BadRecordError("invalid_record"): a
        trace trained without its calls or specs teaches answers that skip the tool. An assistant message's
        "reasoning_content" goes to the template too; when the last assistant turn has one and the template renders
        no reasoning (Qwen2.5-VL's), the record is refused the same way (earlier turns' reasoning is the template's
        to drop: Qwen3's keeps only the turns after the last user message). `strict=False` renders what
        the template renders, as transformers does (the public `apply_chat_template`)."""
        conversation = []
        for m in messages:
            content = m["content"]
            if not isinstance(content, str):
                content = [{"type": "text", "text": it["text"]} if _kind(it) == "text" else {"type": _kind(it)}
                           for it in content]
            conversation.append({"role": m["role"], "content": content,
                                 **{k: m[k] for k in ("tool_calls", "reasoning_content") if m.get(k)}})
        text = self._template(conversation, tools, add_generation_prompt)
        if not strict:
            return text
        if tools and text == self._template(conversation, None, add_generation_prompt):
            raise BadRecordError("invalid_record", f"the chat template of {self.name_or_path or 'the processor'} "
                                                   "does not render the record's tools (tool specs)")
        if any("tool_calls" in m for m in conversation):
            bare = [{k: v for k, v in m.items() if k != "tool_calls"} for m in conversation]
            if text == self._template(bare, tools, add_generation_prompt):
                raise BadRecordError("invalid_record", f"the chat template of {self.name_or_path or 'the processor'} "
                                                       "does not render assistant tool_calls; write the calls into the "
                                                       "assistant text as the model emits them")
        answers = [m for m in conversation if m["role"] == "assistant"]
        if answers and answers[-1].get("reasoning_content"):  # the turn every reasoning template renders it in
            bare = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in conversation]
            if text == self._template(bare, tools, add_generation_prompt):
                raise BadRecordError("invalid_record", f"the chat template of {self.name_or_path or 'the processor'} "
                                                       "does not render assistant reasoning_content; write the reasoning "
                                                       "into the assistant text (e.g. <think>...</think>) as the model "
                                                       "emits it")
        return text

    def apply_chat_template(self, conversation: list[dict], *, tokenize: bool = False,
                            add_generation_prompt: bool = False, tools: Optional[list] = None, **_unused) -> str:
        """Like `ProcessorMixin.apply_chat_template(..., tokenize=False)`: the rendered text."""
        if tokenize:
            raise NotImplementedError("VLProcessor.apply_chat_template renders text only; call the processor on it")
        return self.render(conversation, add_generation_prompt=add_generation_prompt, tools=tools, strict=False)

    def mm_token_type_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """0 text, 1 image placeholder, 2 video placeholder (what transformers' Qwen processors return)."""
        mm = torch.zeros_like(ids)
        mm[ids == self.image_token_id] = 1
        if self.video_token_id is not None:
            mm[ids == self.video_token_id] = 2
        return mm

    def __call__(self, text=None, images=None, videos=None, *, return_tensors: str = "pt", padding=False,
                 padding_side: Optional[str] = None, fps: float = 2.0, **tokenizer_kwargs):
        """Like the family's transformers processor `__call__`: expand the placeholders of `text` (str or
        list) for `images` (PIL, in placeholder order) and `videos` (lists of equal-sized PIL frames
        sampled at `fps`), tokenise, and return input_ids, attention_mask (mm_token_type_ids where the
        family has them) and the vision tensors concatenated in placeholder order. truncation /
        max_length / pad_to_multiple_of / add_special_tokens go to the tokenizer; truncation that cuts
        vision tokens raises ValueError, as transformers' processors do."""
        from transformers import BatchFeature

        from megatron_vlm.data.media import VideoClip, to_rgb

        texts = [text] if isinstance(text, str) else list(text or [])
        images = [images] if images is not None and not isinstance(images, (list, tuple)) else list(images or [])
        # images nested per text ([[text 0's images], [text 1's], ...], as TRL's collator passes them): the
        # placeholders take them in order, as transformers' processors flatten them
        images = [im for x in images for im in (x if isinstance(x, (list, tuple)) else [x])]
        items = {"image": self.process_images([to_rgb(im) for im in images]) if images else [],
                 "video": [self.process_video(VideoClip(list(range(len(v))), len(v), float(fps), v[0].height,
                                                        v[0].width, [to_rgb(f) for f in v]))
                           for v in (videos or [])]}
        order = [k for t in texts for k in placeholder_order(t, self.placeholders)]
        for kind in ("image", "video"):
            if order.count(kind) != len(items[kind]):
                raise ValueError(f"{order.count(kind)} {self.placeholders[kind]} placeholders in the text but "
                                 f"{len(items[kind])} {kind}s")
        expanded, start = [], {"image": 0, "video": 0}
        for t in texts:
            kinds = placeholder_order(t, self.placeholders)
            mine = {k: [it.expansion for it in items[k][start[k]:start[k] + kinds.count(k)]] for k in items}
            for k in start:
                start[k] += kinds.count(k)
            expanded.append(expand(t, self.placeholders, mine))
        kw = {"padding_side": padding_side} if padding_side else {}
        kw.update({k: v for k, v in tokenizer_kwargs.items() if k in _TOKENIZER_KWARGS})
        enc = self.tokenizer(expanded, padding=padding, return_tensors=return_tensors, **kw)
        self._check_runs_survived(enc["input_ids"], [it.expansion for k in items for it in items[k]])
        data: dict[str, Any] = concat_in_order(order, items)
        if self.returns_mm_token_type_ids and torch.is_tensor(enc["input_ids"]):
            data["mm_token_type_ids"] = self.mm_token_type_ids(enc["input_ids"])
        return BatchFeature({**enc, **data})

    def _check_runs_survived(self, input_ids, expansions: list) -> None:
        """ValueError when the tokenised batch holds fewer vision tokens than the expansions wrote
        (truncation cut them: the features would no longer fit the text)."""
        ids = input_ids if torch.is_tensor(input_ids) else torch.tensor(
            [i for row in input_ids for i in (row if isinstance(row, list) else [row])])
        for token, expected in run_counts(expansions).items():
            found = int((ids == self.tokenizer.convert_tokens_to_ids(token)).sum())
            if found != expected:
                kind = "video" if token == self.video_token else "image"
                raise ValueError(f"Mismatch in {kind} token count between text and input_ids: {found} {token} "
                                 f"tokens for {expected} vision features (truncation cut them; raise max_length)")

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)

    def batch_decode(self, *args, **kwargs):
        return self.tokenizer.batch_decode(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name_or_path!r}, vocab={len(self.tokenizer)})"


def concat_in_order(order: Sequence[str], items: dict[str, list[VisionItem]]) -> dict[str, torch.Tensor]:
    """Tensors of the items taken in placeholder `order` ("image" / "video"), concatenated per key."""
    iters = {k: iter(v) for k, v in items.items()}
    parts: dict[str, list[torch.Tensor]] = {}
    for kind in order:
        for key, t in next(iters[kind]).tensors.items():
            parts.setdefault(key, []).append(t)
    return {key: torch.cat(ts) for key, ts in parts.items()}


# ---------------------------------------------------------------------- folder loading
def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None


@dataclass(frozen=True)
class FolderProcessorDicts:
    """The settings a model folder's processor is built from, each as transformers would read it."""

    image: Optional[dict]
    """The image processor's dict; None when the folder has none (a text-only model folder)."""
    image_source: str
    """Where `image` came from, for error messages ("<folder>/preprocessor_config.json" or
    "<folder>/processor_config.json[image_processor]")."""
    video: dict
    """The video processor's dict ({} when the folder has none: the family's defaults apply)."""
    processor: dict
    """processor_config.json itself (processor-level keys such as image_seq_length); {} when absent."""


def folder_processor_dicts(folder: Path) -> FolderProcessorDicts:
    """The image / video processor dicts of `folder` in transformers' (5.x) order of lookup.

    Why: transformers saves a processor as one processor_config.json holding the sub-processors'
    settings as nested "image_processor" / "video_processor" dicts (no preprocessor_config.json), and
    reads those nested dicts before the flat files (`ImageProcessingMixin.get_image_processor_dict`,
    `BaseVideoProcessor.get_video_processor_dict`). Reading only the flat files would refuse such a
    folder, or size images by other limits than transformers (and vLLM) use when both forms are present
    and differ. The order: image = nested "image_processor", else preprocessor_config.json; video =
    nested "video_processor", else video_preprocessor_config.json, else preprocessor_config.json (older
    folders whose video processor transformers builds from the image config)."""
    folder = Path(folder)
    proc_path = folder / "processor_config.json"
    processor = read_json(proc_path) if proc_path.is_file() else {}
    if not isinstance(processor, dict):
        raise ValueError(f"{proc_path}: expected a JSON object, got {type(processor).__name__}")
    flat: dict[str, Optional[dict]] = {}
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        path = folder / name
        flat[name] = _json_object(path) if path.is_file() else None
    image, image_source = flat["preprocessor_config.json"], str(folder / "preprocessor_config.json")
    if "image_processor" in processor:
        image, image_source = _nested(processor, "image_processor", proc_path), f"{proc_path}[image_processor]"
    if "video_processor" in processor:
        video = _nested(processor, "video_processor", proc_path)
    else:
        video = flat["video_preprocessor_config.json"] or flat["preprocessor_config.json"] or {}
    return FolderProcessorDicts(image=image, image_source=image_source, video=video, processor=processor)


def _json_object(path: Path) -> dict:
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _nested(processor: dict, key: str, path: Path) -> dict:
    value = processor[key]
    if not isinstance(value, dict):
        raise ValueError(f"{path}: \"{key}\" must be a JSON object (the {key.replace('_', ' ')}'s settings), got "
                         f"{type(value).__name__}")
    return value


def folder_chat_template(folder: Path, tokenizer) -> str:
    tpl = _template_file_text(folder, ("chat_template.json",))
    if tpl:
        return tpl
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):
        tpl = tpl.get("default")
    return tpl or ""
