"""Deterministic tiny text-only Qwen folders (`qwen2`, `qwen3`, `qwen3_moe`): config + random weights +
tokenizer + chat template, written offline in the layout of a real checkpoint (`Qwen2ForCausalLM`
etc.). Used by the text demos (`[model] synthesize = "tiny_qwen2"`) and the tests; the same loaders
that read a downloaded Qwen2.5-Math folder read these (`load_hf_model`, `load_processor` -> a
`TextProcessor`).

The tokenizer is the tiny byte-level BPE of the VLM demos (`testing.tiny_processor.build_tiny_tokenizer`,
Qwen special tokens, digits and arithmetic words) with a text-only ChatML template: a system turn
only when the conversation has one (so prompts stay short), then `<|im_start|>role\\n...<|im_end|>\\n`
turns and the `<|im_start|>assistant\\n` generation prompt, as Qwen2.5's template renders them.
"""
from __future__ import annotations

from pathlib import Path

from megatron_vlm.data.processor import load_processor
from megatron_vlm.testing.folders import save_random_model
from megatron_vlm.testing.tiny_processor import build_tiny_tokenizer

__all__ = ["TEXT_CHAT_TEMPLATE", "TINY_TEXT_MODEL_TYPES", "build_tiny_text_processor", "tiny_qwen_text_hf_config",
           "build_tiny_qwen_text_folder"]

TINY_TEXT_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe")

TEXT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}{% if 'text' in item %}{{ item['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_text_processor(out_dir: str | Path):
    """Write tokenizer files + chat_template.jinja into `out_dir`; returns the loaded tokenizer."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = TEXT_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(TEXT_CHAT_TEMPLATE)
    return tokenizer


def tiny_qwen_text_hf_config(model_type: str = "qwen2", *, vocab_size: int = 1024, hidden: int = 128, layers: int = 2,
                             eos_token_id: int | None = None, pad_token_id: int | None = None,
                             tie_word_embeddings: bool = True) -> dict:
    """A transformers config.json dict of a tiny model: 4 query / 2 KV heads; qwen3 with an explicit
    head_dim (not hidden / heads), qwen3_moe with 4 experts (top 2, not renormalised) and layer 1 dense."""
    from transformers import Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, eos_token_id=eos_token_id,
                  pad_token_id=pad_token_id, bos_token_id=None, tie_word_embeddings=tie_word_embeddings)
    if model_type == "qwen2":
        cfg, arch = Qwen2Config(**common), "Qwen2ForCausalLM"
    elif model_type == "qwen3":
        cfg, arch = Qwen3Config(**common, head_dim=hidden // 4 + 8), "Qwen3ForCausalLM"
    elif model_type == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, head_dim=hidden // 4, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=hidden // 2, mlp_only_layers=[1], norm_topk_prob=False)
        arch = "Qwen3MoeForCausalLM"
    else:
        raise ValueError(f"tiny text model: model_type {model_type!r} is not one of {TINY_TEXT_MODEL_TYPES}")
    d = cfg.to_dict()
    d["architectures"] = [arch]
    return d


def build_tiny_qwen_text_folder(out_dir: str | Path, *, model_type: str = "qwen2", seed: int = 0, hidden: int = 128,
                                layers: int = 2) -> Path:
    """Create `out_dir` with config.json, model.safetensors, tokenizer files and chat_template.jinja."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tokenizer = build_tiny_text_processor(tmp)
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    hf_config = tiny_qwen_text_hf_config(model_type, vocab_size=(len(tokenizer) + 63) // 64 * 64, hidden=hidden,
                                         layers=layers, eos_token_id=eos, pad_token_id=pad)
    save_random_model(hf_config, tmp, seed)
    load_processor(tmp)  # fails here, not in a run, if the folder is not a loadable text-model folder
    tmp.rename(out_dir)
    return out_dir
