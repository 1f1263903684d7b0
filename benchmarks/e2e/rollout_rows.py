"""The CPU rows of `bench_rollout.py --engines ours,vllm`: shapes, model folders and FLOP counts.

Why a table of named rows: the rollout-speed comparison with vLLM is only meaningful at fixed shapes
(the same Hugging Face folder and prompts for both engines), so each row is a preset, chosen with
`--row a..e` or its name. This module holds what the rows are and how much arithmetic a decode step
does (for the achieved-GEMM-rate figure of the ~110M rows); the timing loop is rollout_engines_row.py.

    a  tiny_qwen2        text Qwen2, hidden 256, 4 layers, vocab 8192; 8 x 66-token prompts x G 8 x 64 new
    b  qwen2_110m        text Qwen2, hidden 768, 8 layers, vocab 32768 (~110M); 4 x 512 x G 8 x 128 new
    c  qwen2_5_vl_image  tiny Qwen2.5-VL (model.synthesize's folder) with a 64-token image per prompt; 8 x G 8 x 64
    d  qwen3_moe_tiny    Qwen3-MoE layout, hidden 256, 4 layers, 8 experts top 2, vocab 8192; 8 x 66 x G 8 x 64
    e  qwen2_110m_long   row b's model, 4 x 512 x G 8 x 512 new (long decodes)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowSpec:
    """One row: the model (a text config, or the tiny VLM folder) and the call's shape."""

    letter: str
    name: str
    model_type: str  # "qwen2" | "qwen3_moe" | "qwen2_5_vl"
    prompts: int
    prompt_tokens: int  # text rows: random ids; the image row: the size its encoder gives (checked at run time)
    group: int
    new_tokens: int
    hidden: int = 0
    layers: int = 0
    vocab: int = 0
    heads: int = 0
    kv_heads: int = 0
    intermediate: int = 0
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    image_tokens: int = 0  # merged vision tokens per prompt (the image row)
    tied: bool = True  # LM head tied to the embedding
    gemm_rate: bool = False  # report the decode step's achieved GEMM rate vs this CPU's fp32 matmul rate

    @property
    def generated_tokens(self) -> int:
        return self.prompts * self.group * self.new_tokens


_110M = dict(model_type="qwen2", hidden=768, layers=8, vocab=32768, heads=12, kv_heads=2, intermediate=2560, tied=False,
             gemm_rate=True)
ROWS: dict[str, RowSpec] = {r.letter: r for r in (
    RowSpec("a", "tiny_qwen2", "qwen2", 8, 66, 8, 64, hidden=256, layers=4, vocab=8192, heads=8, kv_heads=2,
            intermediate=768),
    RowSpec("b", "qwen2_110m", prompts=4, prompt_tokens=512, group=8, new_tokens=128, **_110M),
    RowSpec("c", "qwen2_5_vl_image", "qwen2_5_vl", 8, 0, 8, 64, image_tokens=64),
    RowSpec("d", "qwen3_moe_tiny", "qwen3_moe", 8, 66, 8, 64, hidden=256, layers=4, vocab=8192, heads=8, kv_heads=2,
            intermediate=768, experts=8, top_k=2, moe_intermediate=256),
    RowSpec("e", "qwen2_110m_long", prompts=4, prompt_tokens=512, group=8, new_tokens=512, **_110M),
)}


def resolve_rows(text: str) -> list[RowSpec]:
    """`--row`: comma-separated letters or names, or "all"; unknown entries raise ValueError naming them."""
    by_name = {r.name: r for r in ROWS.values()}
    items = [t.strip() for t in text.split(",") if t.strip()]
    if items == ["all"]:
        return list(ROWS.values())
    unknown = [t for t in items if t not in ROWS and t not in by_name]
    if unknown or not items:
        raise ValueError(f"--row: unknown {unknown or text!r}; known: all, "
                         + ", ".join(f"{r.letter} ({r.name})" for r in ROWS.values()))
    out: list[RowSpec] = []
    for t in items:
        r = ROWS.get(t) or by_name[t]
        if r not in out:
            out.append(r)
    return out


def text_hf_config(spec: RowSpec) -> dict:
    """The config.json of a text row's model (transformers' own config classes, random weights written later)."""
    from transformers import Qwen2Config, Qwen3MoeConfig

    common = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                  num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                  max_position_embeddings=4096, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                  bos_token_id=None, eos_token_id=1, pad_token_id=0, tie_word_embeddings=spec.tied)
    if spec.model_type == "qwen2":
        cfg, arch = Qwen2Config(**common), "Qwen2ForCausalLM"
    elif spec.model_type == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, head_dim=spec.hidden // spec.heads, num_experts=spec.experts,
                             num_experts_per_tok=spec.top_k, moe_intermediate_size=spec.moe_intermediate,
                             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        arch = "Qwen3MoeForCausalLM"
    else:
        raise ValueError(f"row {spec.letter}: {spec.model_type!r} is not a text row")
    d = cfg.to_dict()
    d["architectures"] = [arch]
    return d


def linear_flops_per_token(cfg: dict) -> int:
    """Multiply-add FLOPs (2 per weight) of the weight GEMMs one token passes through: the q/k/v/o projections,
    the MLP (for MoE: the router and top-k experts), the LM head. Attention over the cache is extra
    (`attention_flops_per_token`)."""
    c = cfg.get("text_config", cfg)
    h, n_layers = c["hidden_size"], c["num_hidden_layers"]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    hd = c.get("head_dim") or h // heads
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    experts = c.get("num_experts") or c.get("num_local_experts") or 0  # transformers 5 writes the latter
    per_layer = []
    for i in range(n_layers):
        moe = experts and i not in (c.get("mlp_only_layers") or []) and (i + 1) % c.get("decoder_sparse_step", 1) == 0
        mlp = (h * experts + c["num_experts_per_tok"] * 3 * h * c["moe_intermediate_size"]) if moe else 3 * h * c["intermediate_size"]
        per_layer.append(attn + mlp)
    return 2 * (sum(per_layer) + h * c["vocab_size"])


def attention_flops_per_token(cfg: dict, context: int) -> int:
    """FLOPs of one query token attending over `context` cached positions (QK^T and PV, every head and layer)."""
    c = cfg.get("text_config", cfg)
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 4 * c["num_hidden_layers"] * c["num_attention_heads"] * hd * context


def decode_flops(spec: RowSpec, cfg: dict, prompt_tokens: int) -> tuple[int, int]:
    """(weight-GEMM FLOPs, attention FLOPs) of all decode steps of one call: every sequence runs to its budget, so
    step s decodes prompts x G tokens at context prompt + s."""
    seqs = spec.prompts * spec.group
    steps = spec.new_tokens - 1  # the first new token comes from the prefill
    lin = linear_flops_per_token(cfg) * seqs * steps
    ctx = sum(prompt_tokens + s for s in range(1, steps + 1))
    return lin, attention_flops_per_token(cfg, 1) * seqs * ctx
