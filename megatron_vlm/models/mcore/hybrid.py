"""`parallel.backend = "mcore"` for the Nemotron-H hybrid decoder (Nemotron-3-Nano-VL's language model).

Nemotron-H blocks are single-block residuals `x + mixer(RMSNorm(x))`, the mixer one of Mamba2, attention,
a relu^2 MLP or a MoE (models/nemotron_vl/model.py). Each native `NemotronHBlock` becomes a
`McoreHybridBlock` holding the megatron-core layer of megatron-core's hybrid stack (`MambaStack`: its
`mamba_layer` / `attention_layer` / `mlp_layer` / `moe_layer` kinds):

* Mamba2 -> `MambaLayer` (its `norm` and residual) whose mixer is our verified `Mamba2Mixer`
  (models/common/mamba2.py), given to the layer as a `ModuleSpec`. Why not megatron-core's `MambaMixer`:
  in megatron-core 0.16.1 it raises ImportError without the mamba_ssm CUDA package (its chunked scan,
  gated RMSNorm and state update are mamba_ssm Triton kernels), so it cannot run on the CPU, and its
  decoding state lives in megatron-core's inference contexts, not in our engine's per-slot `Mamba2State`.
  Our mixer runs the project's kernel registry (mamba-ssm kernels on CUDA where installed) and keeps the
  packed (`cu_seqlens`), padded and decoding forms; its parameter names are megatron's / transformers'.
* attention -> a `TransformerLayer` with `input_layernorm` + `SelfAttention` (`linear_qkv`, `linear_proj`)
  and no MLP; the attention runs through our `attend` (no positional encoding), as McoreDecoderLayer does.
* MLP -> megatron-core's `MLPLayer` (`pre_mlp_layernorm` + `MLP`, non-gated, `squared_relu` for relu^2).
* MoE -> a `TransformerLayer` with `pre_mlp_layernorm` + megatron-core's `MoELayer` (models/mcore/moe_layer.py:
  sigmoid router with the expert bias, shared expert); with parallel.ep > 1 its all-to-all dispatcher and this
  rank's experts as DTensors on the ep mesh (ep_shard.py), as for McoreDecoderLayer's MoE layers.

Tensor parallelism (parallel.tp > 1; the layout of the native backend's tp, parallel/tensor_parallel.py, with
plain tp inside the block as McoreDecoderLayer has: the block takes and returns the whole sequence):

* attention: megatron-core's column / row parallel `linear_qkv` / `linear_proj` over its tp group (our mesh's),
  this rank's blocks of the converted weights as DTensors (tp_shard.py), attention on the rank's heads;
* MLP: `linear_fc1` row blocks (non-gated: a plain row split), `linear_fc2` column blocks;
* Mamba2: our mixer runs this rank's heads (`Mamba2Mixer.tp_shard`, as native tp does) on whole weights
  (`Replicate` DTensors whose gradient, non-zero on the rank's heads only, is summed over tp); its input goes
  through megatron-core's copy-to-tp region (gradient all-reduced), its output, a partial sum over the
  heads, through the reduce-from-tp region (all-reduced);
* MoE: replicated over the tp ranks (whole on each, the whole sequence: megatron-core's MoELayer given a
  tp group of size 1, `moe_layer.replicated_over_tp`), as the native MoE blocks under tp; its parameters are
  `Replicate` with the same gradient on every tp rank (counted once in the gradient norm).

The HF export gathers the blocks back to the full native weights (`native_state`).

Context parallelism (parallel.cp > 1), as the native Nemotron-H blocks: the attention, MLP and MoE blocks get
`apply_cp`'s hooks (this rank's chunks of the pack; the attention over the group's all-gathered keys / values
through `attend`'s `context_parallel`), the Mamba2 blocks do not and run the whole sequence on every cp rank
(their recurrent state would have to pass from chunk to chunk; `parallel_plan._apply_context_parallel` leaves
out every layer holding a `Mamba2Mixer`, ours inside the MambaLayer included).

The layers come from megatron-core's local spec pieces (the MoE and hybrid layers do not use the
Transformer Engine spec: its fused norm + linear modules and TEGroupedMLP have other weight layouts that
are not mapped here). The block keeps the native call signature (`attention_mask`, `cu_seqlens`,
`max_seqlen`, `cache`, `layer_idx`) and the attributes the decoding cache reads (`block_type`, `mixer`),
so training, the engine's KV / Mamba2 state caches and evaluation run unchanged. Weights convert exactly
both ways (`load_native` / `native_state`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from megatron_vlm.models.common.attention import attend
from megatron_vlm.models.common.mamba2 import Mamba2Mixer
from megatron_vlm.models.common.moe import MoE
from megatron_vlm.models.mcore.convert import _fuse_qkv, _split_qkv
from megatron_vlm.models.mcore.ep_shard import distribute_expert_params, global_to_full_experts, shard_expert_state
from megatron_vlm.models.mcore.errors import McoreBackendError
from megatron_vlm.models.mcore.moe_layer import mcore_to_moe, moe_config_kwargs, moe_layer_spec, moe_to_mcore
from megatron_vlm.models.mcore.parallel_state import ensure_parallel_state
from megatron_vlm.models.mcore.tp_shard import (
    distribute_layer_params,
    global_to_full,
    load_local_state,
    local_params,
    shard_layer_state,
)

__all__ = ["McoreHybridBlock", "check_hybrid_block", "is_hybrid_block"]


def is_hybrid_block(layer: nn.Module) -> bool:
    from megatron_vlm.models.nemotron_vl.model import NemotronHBlock

    return isinstance(layer, NemotronHBlock)


def _error(msg: str):
    return McoreBackendError(f"parallel.backend = 'mcore': {msg}")


def _mlp_activation(name: str):
    from megatron.core.activations import squared_relu

    acts = {"relu2": squared_relu, "silu": F.silu, "gelu": F.gelu}
    if name not in acts:
        raise _error(f"Nemotron-H MLP activation {name!r} is not mapped (relu2, silu, gelu are)")
    return acts[name]


def check_hybrid_block(i: int, block: nn.Module) -> None:
    """McoreBackendError naming the feature a Nemotron-H block uses that is not mapped."""
    kind = block.block_type
    if kind == "full_attention":
        attn = block.mixer
        if attn.q_proj.bias is not None or attn.o_proj.bias is not None or attn.q_norm is not None:
            raise _error(f"decoder layer {i}: attention biases / QK-norm are not mapped for Nemotron-H")
    elif kind == "mlp":
        if block.mixer.up_proj.bias is not None:
            raise _error(f"decoder layer {i}: MLP biases (mlp_bias) are not mapped")
    elif kind == "moe":
        moe_config_kwargs(block.mixer)  # raises naming the routing feature
    elif kind != "linear_attention":
        raise _error(f"decoder layer {i}: Nemotron-H block type {kind!r} is not mapped")


class _NativeMamba2Mixer(Mamba2Mixer):
    """Our Mamba2 mixer with the constructor megatron-core's MambaLayer builds its mixer with."""

    def __init__(self, config, d_model: int, layer_number: Optional[int] = None, pg_collection=None,
                 pp_layer_offset: int = 0, **mixer_kwargs) -> None:
        super().__init__(d_model, **mixer_kwargs)


def _mixer_kwargs(m: Mamba2Mixer) -> dict:
    lo, hi, floor = m._dt_init
    return dict(num_heads=m.num_heads, head_dim=m.head_dim, state_size=m.state_size, n_groups=m.n_groups,
                conv_kernel=m.conv_kernel, chunk_size=m.chunk_size, use_conv_bias=m.conv1d.bias is not None,
                use_bias=m.in_proj.bias is not None, norm_eps=m.norm.eps, time_step_min=lo, time_step_max=hi,
                time_step_floor=floor)


def _config(model_args, num_layers: int, dtype: torch.dtype, moe: Optional[MoE], ep: int = 1, tp: int = 1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    a = model_args
    extra = moe_config_kwargs(moe) if moe is not None else {}
    if ep > 1:  # expert parallelism: E / ep experts per rank, tokens sent with all-to-alls (ep_shard.py)
        extra.update(moe_token_dispatcher_type="alltoall", expert_model_parallel_size=ep)
    return TransformerConfig(
        num_layers=num_layers, hidden_size=a.hidden_size, ffn_hidden_size=a.intermediate_size,
        num_attention_heads=a.num_attention_heads, num_query_groups=a.num_key_value_heads, kv_channels=a.head_dim,
        normalization="RMSNorm", layernorm_epsilon=a.layer_norm_epsilon, gated_linear_unit=False,
        activation_func=_mlp_activation(a.mlp_hidden_act), add_bias_linear=False, add_qkv_bias=False,
        qk_layernorm=False, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, use_cpu_initialization=True,
        perform_initialization=False, tensor_model_parallel_size=tp, sequence_parallel=False,
        expert_tensor_parallel_size=1, **{k: v for k, v in extra.items()
                                         if k not in ("gated_linear_unit", "activation_func", "add_bias_linear")},
    )


def _spec(kind: str, config, native: nn.Module, ep_group=None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    moe = kind == "moe"
    local = get_gpt_layer_local_spec(normalization="RMSNorm", num_experts=config.num_moe_experts if moe else None,
                                     moe_grouped_gemm=False)
    sub = local.submodules
    norm = sub.input_layernorm
    if kind == "linear_attention":
        mixer = ModuleSpec(module=_NativeMamba2Mixer, params=_mixer_kwargs(native.mixer))
        return ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(norm=norm, mixer=mixer))
    if kind == "full_attention":
        return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=norm, self_attention=sub.self_attention, self_attn_bda=sub.self_attn_bda))
    if kind == "mlp":
        return ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=sub.pre_mlp_layernorm, mlp=sub.mlp, mlp_bda=sub.mlp_bda))
    mlp = moe_layer_spec(sub.mlp, expert_bias=native.mixer.gate.e_score_correction_bias is not None, ep_group=ep_group)
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=sub.pre_mlp_layernorm, mlp=mlp, mlp_bda=sub.mlp_bda))


class McoreHybridBlock(nn.Module):
    """A `NemotronHBlock` stand-in (same call signature and cache attributes) around a megatron-core
    layer (`self.mcore`) of the block's kind."""

    te_fused_norms = False
    tp_sharded_itself = True
    """`parallel.tensor_parallel.apply_tp` leaves this block alone: it splits itself (`tp_mesh`)."""
    context_parallel = None
    """Set by `parallel.context_parallel.apply_cp` on the attention / MLP / MoE blocks (the Mamba2 blocks, holding a
    `Mamba2Mixer`, are left out: they run the whole sequence); the attention passes it to `attend`."""

    def __init__(self, native: nn.Module, index: int, model_args, tp_mesh=None, ep_mesh=None,
                 grad_divide_factor: float = 1.0) -> None:
        super().__init__()
        from megatron.core.transformer.spec_utils import build_module

        check_hybrid_block(index, native)
        self.block_type = native.block_type
        # tensor parallelism (module docstring): attention / MLP split by megatron-core's linears, Mamba2 heads
        # split by our mixer, MoE replicated
        self.tp = 1 if tp_mesh is None else tp_mesh.size()
        self.tp_rank = 0 if tp_mesh is None else tp_mesh.get_local_rank()
        self._tp_group = None if tp_mesh is None else tp_mesh.get_group()
        dtype = native.norm.weight.dtype
        moe = native.mixer if self.block_type == "moe" else None
        # expert parallelism (MoE blocks; ep_shard.py): this rank holds experts ep_rank * E/ep ...
        self.ep = 1 if ep_mesh is None or moe is None else ep_mesh.size(ep_mesh.ndim - 1)
        self.ep_rank = 0 if self.ep == 1 else ep_mesh.get_local_rank(ep_mesh.ndim - 1)
        if self.ep > 1 and moe.num_experts % self.ep:
            raise _error(f"parallel.ep = {self.ep}: decoder layer {index} has {moe.num_experts} routed experts, not "
                         "divisible by the expert-parallel size")
        config = _config(model_args, model_args.num_hidden_layers, dtype, moe, self.ep, self.tp)
        self.heads = dict(num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_query_groups)
        self.head_dim = config.kv_channels
        self._gated_experts = bool(moe is not None and moe.experts.gated)
        from megatron.core.process_groups_config import ProcessGroupCollection

        ensure_parallel_state(tp_mesh, ep_mesh)
        pgs = ProcessGroupCollection.use_mpu_process_groups()  # megatron-core's groups (tp, pp = 1, ep)
        ep_group = ep_mesh.get_group(ep_mesh.ndim - 1) if self.ep > 1 else None  # ours (ensure_parallel_state)
        self.mcore = build_module(_spec(self.block_type, config, native, ep_group), config=config, layer_number=index + 1,
                                  pg_collection=pgs)
        self.mcore.to(native.norm.weight.device)
        if self.tp > 1 and self.block_type == "linear_attention":
            self.mcore.mixer.tp_shard(self.tp, self.tp_rank)  # this rank's heads; the weights stay whole
        self.load_native(native.state_dict())
        if self.ep > 1:  # the expert weights first: on the ep mesh, replicated over tp (left alone by the tp step)
            distribute_expert_params(self.mcore, ep_mesh, grad_divide_factor)
        if self.tp > 1:
            distribute_layer_params(self.mcore, tp_mesh, partial_grad_prefixes=("mixer.",))

    # ----- what the decoding caches read -----
    @property
    def mixer(self):
        """The Mamba2 mixer (its state shapes), this block for attention (`local_heads`, `head_dim`)."""
        if self.block_type == "linear_attention":
            return self.mcore.mixer
        return self

    def local_heads(self) -> tuple[int, int]:
        """(query heads, KV heads) this rank computes: the KV cache holds these."""
        return self.heads["num_attention_heads"] // self.tp, self.heads["num_key_value_heads"] // self.tp

    # ----- weights, both ways -----
    def _to_mcore(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = dict(state)
        kind = self.block_type
        if kind == "linear_attention":
            return state  # MambaLayer.norm / .mixer are the native names
        norm = state.pop("norm.weight")
        if kind == "full_attention":
            q, k, v = (state.pop(f"mixer.{n}_proj.weight") for n in "qkv")
            out = {"input_layernorm.weight": norm,
                   "self_attention.linear_qkv.weight": _fuse_qkv(q, k, v, **self._heads_args()),
                   "self_attention.linear_proj.weight": state.pop("mixer.o_proj.weight")}
        elif kind == "mlp":
            out = {"pre_mlp_layernorm.weight": norm, "mlp.linear_fc1.weight": state.pop("mixer.up_proj.weight"),
                   "mlp.linear_fc2.weight": state.pop("mixer.down_proj.weight")}
        else:
            moe = {k.removeprefix("mixer."): state.pop(k) for k in list(state) if k.startswith("mixer.")}
            out = {"pre_mlp_layernorm.weight": norm, **{f"mlp.{k}": v for k, v in moe_to_mcore(moe).items()}}
        if state:
            raise KeyError(f"McoreHybridBlock ({kind}): no megatron-core counterpart for {sorted(state)}")
        return out

    def _heads_args(self) -> dict:
        return dict(num_heads=self.heads["num_attention_heads"], num_kv_heads=self.heads["num_key_value_heads"])

    def load_native(self, state: dict) -> None:
        """Load a native NemotronHBlock state dict, converted exactly (this rank's blocks of the attention / MLP
        weights under tp > 1, its experts under ep > 1)."""
        converted = self._to_mcore(state)
        if self.tp > 1:
            converted = shard_layer_state(converted, self.tp, self.tp_rank, gated=False)
        if self.ep > 1:
            converted = shard_expert_state(converted, self.ep, self.ep_rank)
        missing, unexpected = load_local_state(self.mcore, converted)  # after distribute_*_params: into the local blocks
        if missing or unexpected:
            raise _error(f"megatron-core {self.block_type} layer: weights missing {missing}, unexpected {unexpected}")

    def native_state(self, state: Optional[dict] = None) -> dict:
        """This block's weights (or `state`, keys relative to `self.mcore`, global tensors) under native
        NemotronHBlock names, full tensors: all experts, all tp blocks (gathered over ep / tp: collective when
        `state` is None)."""
        state = self.mcore.state_dict() if state is None else state
        state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()
                 if not k.endswith("_extra_state")}
        state = global_to_full(global_to_full_experts(state, self.ep), self.tp, gated=False)
        kind = self.block_type
        if kind == "linear_attention":
            return dict(state)
        if kind == "full_attention":
            out = {"norm.weight": state.pop("input_layernorm.weight"),
                   "mixer.o_proj.weight": state.pop("self_attention.linear_proj.weight")}
            qkv = _split_qkv(state.pop("self_attention.linear_qkv.weight"), **self._heads_args())
            out.update({f"mixer.{n}_proj.weight": t for n, t in zip("qkv", qkv)})
        elif kind == "mlp":
            out = {"norm.weight": state.pop("pre_mlp_layernorm.weight"), "mixer.up_proj.weight": state.pop("mlp.linear_fc1.weight"),
                   "mixer.down_proj.weight": state.pop("mlp.linear_fc2.weight")}
        else:
            out = {"norm.weight": state.pop("pre_mlp_layernorm.weight")}
            moe = {k.removeprefix("mlp."): state.pop(k) for k in list(state) if k.startswith("mlp.")}
            out.update({f"mixer.{k}": v for k, v in mcore_to_moe(moe, gated=self._gated_experts).items()})
        if state:
            raise KeyError(f"McoreHybridBlock ({kind}): no native counterpart for {sorted(state)}")
        return out

    @local_params
    def forward(
        self,
        x: torch.Tensor,
        *,
        attention_mask: Optional[torch.Tensor] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        max_seqlen: Optional[int] = None,
        cache=None,
        layer_idx: int = 0,
    ) -> torch.Tensor:
        """x [B, T, hidden] (packed: B = 1 with cu_seqlens); attention_mask [B, T] of real tokens."""
        layer, kind = self.mcore, self.block_type
        if kind == "linear_attention":
            state = None if cache is None else cache.mamba_state(layer_idx)
            h = layer.norm(x)
            if self.tp > 1:  # this rank's heads: the input's gradient and the output are partial sums over tp
                from megatron.core.tensor_parallel.mappings import (
                    copy_to_tensor_model_parallel_region,
                    reduce_from_tensor_model_parallel_region,
                )

                h = copy_to_tensor_model_parallel_region(h, group=self._tp_group)
            out = layer.mixer(h, attention_mask=attention_mask, cu_seqlens=cu_seqlens, state=state)
            if self.tp > 1:
                out = reduce_from_tensor_model_parallel_region(out, group=self._tp_group)
            return x + out
        if kind == "full_attention":  # no positional encoding: cos / sin None skip the rotary
            q, k, v = layer.self_attention.get_query_key_value_tensors(layer.input_layernorm(x))
            if cu_seqlens is not None:
                out = attend(q[0], k[0], v[0], None, None, causal=True, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                             context_parallel=self.context_parallel)[None]
            elif cache is not None:
                out = attend(q, k, v, None, None, causal=True, kv_cache=cache.kv, layer_idx=cache.kv_index(layer_idx))
            else:
                mask = None if attention_mask is None else attention_mask.bool()
                out = attend(q, k, v, None, None, causal=True, key_padding_mask=mask)
            proj, bias = layer.self_attention.linear_proj(out.reshape(*out.shape[:-2], -1))
            return x + proj if bias is None else x + proj + bias
        h = layer.pre_mlp_layernorm(x)
        out, bias = layer.mlp(h, token_mask=attention_mask) if kind == "moe" else layer.mlp(h)
        return x + out if bias is None else x + out + bias
