"""HF <-> megatron-core state dicts of a dense Qwen2 / Qwen3-style language decoder (the language
models of Qwen2.5-VL, InternVL3 and dense Qwen3-VL, and the text-only Qwen2 / Qwen3 LMs).

Why a converter and not a loader: megatron-core's GPT layers fuse what HF keeps apart — q, k and v
are one `linear_qkv` whose rows are grouped per KV head ([q heads of the group, k, v] for each of the
`num_key_value_heads` groups, so a tensor-parallel split by rows keeps whole groups), and gate / up
are one `linear_fc1` ([gate; up]). The layout here is the one of megatron-core's local layer spec
(`get_gpt_layer_local_spec`): separate `input_layernorm` / `pre_mlp_layernorm`; with Transformer
Engine layers the norms are fused into `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight`
(`te_fused_norms=True`). The conversion is exact (only concatenation and slicing), both ways.

Keys: HF `model.embed_tokens.weight`, `model.layers.{i}.…`, `model.norm.weight`, `lm_head.weight`
(absent when embeddings are tied) <-> megatron-core `embedding.word_embeddings.weight`,
`decoder.layers.{i}.…`, `decoder.final_layernorm.weight`, `output_layer.weight`.
Qwen3-MoE blocks (transformers' fused expert tensors `mlp.experts.gate_up_proj` [E, 2I, H] and
`mlp.experts.down_proj` [E, H, I], router `mlp.gate.weight`) <-> megatron-core's MoE layer with local
experts (`mlp.router.weight`, `mlp.experts.local_experts.{j}.linear_fc1 / linear_fc2.weight`).
Mamba2 (Nemotron-H) layers are not converted here: a key this module does not know is an error.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch

__all__ = ["hf_to_mcore", "mcore_to_hf"]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MCORE_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER_KEYS = frozenset(
    [f"self_attn.{n}_proj.{kind}" for n in "qkv" for kind in ("weight", "bias")]
    + ["self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
       "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
       "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]
)
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


def _check_heads(num_heads: int, num_kv_heads: int) -> int:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    return num_heads // num_kv_heads


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """[q rows; k rows; v rows] (HF) -> rows grouped per KV head (megatron-core); works for weights and biases."""
    per = _check_heads(num_heads, num_kv_heads)
    head_dim = q.shape[0] // num_heads
    tail = q.shape[1:]
    qg = q.reshape(num_kv_heads, per * head_dim, *tail)
    kg = k.reshape(num_kv_heads, head_dim, *tail)
    vg = v.reshape(num_kv_heads, head_dim, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *tail)


def _split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int):
    per = _check_heads(num_heads, num_kv_heads)
    tail = qkv.shape[1:]
    head_dim = qkv.shape[0] // (num_kv_heads * (per + 2))
    g = qkv.reshape(num_kv_heads, (per + 2) * head_dim, *tail)
    q, k, v = g.split([per * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _norm_keys(te_fused_norms: bool) -> tuple[str, str]:
    if te_fused_norms:
        return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


def hf_to_mcore(hf: Mapping[str, torch.Tensor], *, num_attention_heads: int, num_key_value_heads: int,
                te_fused_norms: bool = False) -> dict[str, torch.Tensor]:
    """HF language-model state dict -> megatron-core GPTModel state dict (module docstring)."""
    out: dict[str, torch.Tensor] = {}
    in_norm, mlp_norm = _norm_keys(te_fused_norms)
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in hf.items():
        m = _LAYER.match(key)
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = value
        elif key == "model.embed_tokens.weight":
            out["embedding.word_embeddings.weight"] = value
        elif key == "model.norm.weight":
            out["decoder.final_layernorm.weight"] = value
        elif key == "lm_head.weight":
            out["output_layer.weight"] = value
        else:
            raise KeyError(f"hf_to_mcore: no megatron-core counterpart for {key!r}")
    for i, p in sorted(layers.items()):
        pre = f"decoder.layers.{i}."
        p = dict(p)
        unknown = sorted(set(p) - _HF_LAYER_KEYS)
        if unknown:
            raise KeyError(f"hf_to_mcore: layer {i} has keys without a megatron-core counterpart: {unknown}")
        try:
            for kind in ("weight", "bias"):
                qkv = [p.pop(f"self_attn.{n}_proj.{kind}", None) for n in "qkv"]
                if all(t is not None for t in qkv):
                    out[pre + f"self_attention.linear_qkv.{kind}"] = _fuse_qkv(*qkv, num_attention_heads, num_key_value_heads)
                elif any(t is not None for t in qkv):
                    raise KeyError(f"hf_to_mcore: layer {i} has only some of q/k/v_proj.{kind}")
            out[pre + "self_attention.linear_proj.weight"] = p.pop("self_attn.o_proj.weight")
            if "mlp.experts.gate_up_proj" in p:
                out[pre + "mlp.router.weight"] = p.pop("mlp.gate.weight")
                for j, (fc1, fc2) in enumerate(zip(p.pop("mlp.experts.gate_up_proj"), p.pop("mlp.experts.down_proj"))):
                    out[pre + f"mlp.experts.local_experts.{j}.linear_fc1.weight"] = fc1
                    out[pre + f"mlp.experts.local_experts.{j}.linear_fc2.weight"] = fc2
            else:
                out[pre + "mlp.linear_fc1.weight"] = torch.cat([p.pop("mlp.gate_proj.weight"), p.pop("mlp.up_proj.weight")])
                out[pre + "mlp.linear_fc2.weight"] = p.pop("mlp.down_proj.weight")
            out[pre + in_norm] = p.pop("input_layernorm.weight")
            out[pre + mlp_norm] = p.pop("post_attention_layernorm.weight")
        except KeyError as e:
            raise KeyError(f"hf_to_mcore: layer {i} lacks {e.args[0]!r}") from None
        for hf_name, mc_name in (("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
                                 ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight")):
            if hf_name in p:
                out[pre + mc_name] = p.pop(hf_name)
    return out


def mcore_to_hf(mc: Mapping[str, torch.Tensor], *, num_attention_heads: int, num_key_value_heads: int,
                te_fused_norms: bool = False) -> dict[str, torch.Tensor]:
    """megatron-core GPTModel state dict -> HF language-model state dict; `_extra_state` entries (TE /
    local-layer metadata, no weights) are dropped."""
    out: dict[str, torch.Tensor] = {}
    in_norm, mlp_norm = _norm_keys(te_fused_norms)
    simple = {
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
        in_norm: "input_layernorm.weight",
        mlp_norm: "post_attention_layernorm.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    }
    experts: dict[tuple, dict[int, torch.Tensor]] = {}
    for key, value in mc.items():
        if key.endswith("._extra_state"):
            continue
        m = _MCORE_LAYER.match(key)
        if not m:
            top = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
                   "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}
            if key not in top:
                raise KeyError(f"mcore_to_hf: no HF counterpart for {key!r}")
            out[top[key]] = value
            continue
        pre, name = f"model.layers.{m.group(1)}.", m.group(2)
        e = _EXPERT.match(name)
        if e:
            experts.setdefault((pre, e.group(2)), {})[int(e.group(1))] = value
        elif name == "mlp.router.weight":
            out[pre + "mlp.gate.weight"] = value
        elif name in simple:
            out[pre + simple[name]] = value
        elif name.startswith("self_attention.linear_qkv."):
            kind = name.rsplit(".", 1)[1]
            for n, t in zip("qkv", _split_qkv(value, num_attention_heads, num_key_value_heads)):
                out[pre + f"self_attn.{n}_proj.{kind}"] = t
        elif name == "mlp.linear_fc1.weight":
            gate, up = value.chunk(2, dim=0)
            out[pre + "mlp.gate_proj.weight"], out[pre + "mlp.up_proj.weight"] = gate, up
        else:
            raise KeyError(f"mcore_to_hf: no HF counterpart for {key!r}")
    for (pre, which), by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise KeyError(f"mcore_to_hf: {pre} has experts {sorted(by_index)}, not 0..{len(by_index) - 1}")
        name = "mlp.experts.gate_up_proj" if which == "linear_fc1" else "mlp.experts.down_proj"
        out[pre + name] = torch.stack([by_index[j] for j in range(len(by_index))])
    return out
