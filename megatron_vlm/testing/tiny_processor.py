"""A tiny, deterministic, offline Qwen2.5-VL tokenizer + processor folder for tests and the demo.

The tokenizer is a byte-level BPE (no unknown tokens: any text round-trips) trained with the
`tokenizers` library on a fixed word list — the synthetic VQA vocabulary, digits, punctuation and
common English words, plus `extra_words` — so that task text becomes few tokens and the tiny model's
vocabulary stays small (~1000). Training is deterministic (same bytes in every process). Qwen2.5-VL's
special tokens follow the learned vocabulary, as in the real model, and the chat template behaves
like Qwen2.5-VL's (default system prompt, `<|vision_start|><|image_pad|><|vision_end|>` per image,
the video twin, optional "Picture N: " labels, generation prompt).

The folder has the layout of a real Qwen2.5-VL checkpoint: tokenizer.json / tokenizer_config.json,
chat_template.jinja, preprocessor_config.json (Qwen2VLImageProcessor, small min/max pixels, patch
14, merge 2, temporal patch 2), video_preprocessor_config.json and processor_config.json
(`Qwen2_5_VLProcessor`). Where torchvision is installed `AutoProcessor.from_pretrained(out_dir)`
loads it; without torchvision transformers cannot build any Qwen2-VL video processor, hence no
`Qwen2_5_VLProcessor` at all, so we return (and the trainer uses)
`megatron_vlm.data.processor.load_processor(out_dir)`, which needs only the tokenizer and the PIL
image processor. `AutoTokenizer.from_pretrained(out_dir)` works everywhere.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from megatron_vlm.data.processor import load_processor
from megatron_vlm.data.synthetic_vqa import ANSWERS, QUESTION_TYPES, VOCABULARY_WORDS, _question
from megatron_vlm.testing.folders import QWEN_VL_ITEMS, chatml_template, save_image_processor, write_json

__all__ = [
    "SPECIAL_TOKENS", "QWEN2_5_VL_CHAT_TEMPLATE", "build_tiny_tokenizer", "build_tiny_qwen2_5_vl_processor",
    "tiny_qwen2_5_vl_text_config_ids", "TINY_IMAGE_MIN_PIXELS", "TINY_IMAGE_MAX_PIXELS",
]

SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
TINY_IMAGE_MIN_PIXELS = 56 * 56
TINY_IMAGE_MAX_PIXELS = 28 * 28 * 16          # at most 16 merged tokens per image (e.g. 112x112)
TINY_VIDEO_MIN_PIXELS = 56 * 56
TINY_VIDEO_MAX_PIXELS = 28 * 28 * 4           # at most 4 merged tokens per frame pair
_BPE_VOCAB_SIZE = 960                         # byte alphabet (256) + merges; specials come after

# Behaviour of Qwen2.5-VL-Instruct's chat template (written here, not copied): a default system
# turn when the first message is not a system one; string content verbatim; list content renders
# images / videos as placeholders (optionally labelled "Picture N: " / "Video N: ") and text as is.
# The pieces carry no incidental whitespace, so no Jinja whitespace control is needed.
QWEN2_5_VL_CHAT_TEMPLATE = chatml_template(QWEN_VL_ITEMS, default_system=True, count_items=True)

_COMMON_WORDS = ["a", "an", "the", "and", "or", "not", "no", "yes", "of", "to", "in", "on", "at", "by", "for", "with", "from", "as", "is", "are", "was", "were", "be", "been", "it", "this", "that", "these", "those", "there", "here", "what", "which", "who", "whom", "whose", "when", "where", "why", "how", "many", "much", "more", "most", "some", "any", "all", "each", "every", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "zero", "first", "second", "third", "last", "left", "right", "top", "bottom", "middle", "center", "centre", "above", "below", "next", "near", "far", "big", "small", "large", "little", "image", "picture", "photo", "video", "frame", "frames", "shown", "show", "shows", "see", "look", "answer", "question", "final", "number", "color", "colour", "shape", "shapes", "object", "objects", "count", "total", "sum", "area", "angle", "triangle", "circle", "square", "line", "point", "side", "length", "width", "height", "degree", "degrees", "value", "find", "compute", "solve", "therefore", "so", "then", "if", "I", "you", "he", "she", "we", "they", "me", "my", "your", "our", "their", "do", "does", "did", "can", "could", "should", "would", "will", "have", "has", "had", "robot", "arm", "hand", "table", "cup", "box", "move", "pick", "place", "put", "open", "close", "task", "done", "step", "think", "reason", "because", "describe", "please", "correct", "wrong", "true", "false", "equal", "greater", "less", "than", "plus", "minus", "times", "divided"]
_PUNCTUATION = list(".,:;!?'\"()[]{}<>+-*/=%$#@&_^|~\\") + ["\n", "\n\n", "  "]


def _training_corpus(extra_words: Iterable[str]) -> list[str]:
    words = list(VOCABULARY_WORDS) + _COMMON_WORDS + [str(d) for d in range(10)] + list(extra_words)
    lines = []
    # Repetition sets merge priority: task words first, then common words, then the rest.
    for w in words:
        lines += [w, " " + w, w.capitalize(), " " + w.capitalize()]
    for q in QUESTION_TYPES:
        subjects = {"count": [""], "colour_of_shape": ["circle", "square", "triangle"],
                    "shape_of_colour": list(ANSWERS["colour_of_shape"])}[q]
        lines += [_question(q, s) for s in subjects] * 4
    lines += ["".join(_PUNCTUATION), "You are a helpful assistant."] * 4
    lines += [f"{a} {b}" for a in range(10) for b in range(10)]
    return lines


def build_tiny_tokenizer(extra_words: Iterable[str] = ()):
    """The byte-level BPE tokenizer (a transformers `PreTrainedTokenizerFast`) with Qwen specials."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE + len(list(extra_words)),
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(extra_words), trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = QWEN2_5_VL_CHAT_TEMPLATE
    return fast



def build_tiny_qwen2_5_vl_processor(out_dir: str | os.PathLike, *, extra_words: Iterable[str] = ()):
    """Write the tokenizer + processor folder into `out_dir` and return the loaded processor
    (`megatron_vlm.data.processor.VLProcessor`). Same inputs -> same files."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    extra_words = list(extra_words)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(extra_words)
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(QWEN2_5_VL_CHAT_TEMPLATE)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=TINY_IMAGE_MIN_PIXELS, max_pixels=TINY_IMAGE_MAX_PIXELS)
    pre = save_image_processor(out, image_processor, "Qwen2VLImageProcessor", "Qwen2_5_VLProcessor")
    write_json(out / "video_preprocessor_config.json", {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True, "resample": 3,
        "image_mean": pre["image_mean"], "image_std": pre["image_std"],
        "size": {"shortest_edge": TINY_VIDEO_MIN_PIXELS, "longest_edge": TINY_VIDEO_MAX_PIXELS},
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "do_sample_frames": False,
    })
    write_json(out / "processor_config.json", {"processor_class": "Qwen2_5_VLProcessor"})
    return load_processor(out)


def tiny_qwen2_5_vl_text_config_ids(processor) -> dict:
    """Token ids and vocabulary size a Qwen2.5-VL config.json needs for this tokenizer.

    vocab_size is len(tokenizer) rounded up to a multiple of 64 (as real checkpoints pad it)."""
    tok = getattr(processor, "tokenizer", processor)
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("bos_token_id", "<|endoftext|>"), ("eos_token_id", "<|im_end|>"), ("pad_token_id", "<|endoftext|>"),
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
        ("vision_token_id", "<|vision_pad|>"),
    )}
    n = len(tok)
    ids["vocab_size"] = (n + 63) // 64 * 64
    return ids
