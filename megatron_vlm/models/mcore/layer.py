"""`parallel.backend = "mcore"`: the language decoder's layers are megatron-core `TransformerLayer`s.

Why a layer swap and not megatron-core's `GPTModel`: everything around the decoder layers stays ours and
unchanged — token embedding, vision tower and merge, M-RoPE / DeepStack positions and injections, final
norm, the fused LM-head log-probs, packing, checkpoints and export. Each family's `DecoderLayer` is
replaced, after its HF weights are loaded, by a `McoreDecoderLayer` holding a megatron-core
`TransformerLayer` built from a layer spec (`get_gpt_layer_local_spec`: megatron-core's own column / row
parallel linears and norms; Transformer Engine's fused LayerNorm-linear modules when TE is installed), its
weights converted from the native layer (`convert.py`, exact).

Why the layer's forward is composed here from the TransformerLayer's submodules (input norm, `linear_qkv`
with QK-norm, `linear_proj`, pre-MLP norm, MLP) instead of calling `TransformerLayer.forward`: the
attention itself runs through our `attend` (models/common/attention.py) — the kernel registry (SDPA on the
CPU, our Triton kernel or flash-attn on CUDA), packed varlen samples without an S x S mask, shared-prompt
packs, the KV / slot caches of decoding and evaluation, the per-token M-RoPE angles — none of which
megatron-core's core attention takes without Transformer Engine's THD path. The math equals the native
layer's (tests/unit/mcore/test_mcore_backend.py: logits, gradients and the HF export).

MoE layers (Qwen3-VL-MoE, Qwen3-MoE) hold megatron-core's `MoELayer` (router, token dispatcher, experts:
models/mcore/moe_layer.py, local spec); the Nemotron-H hybrid's blocks become `McoreHybridBlock`s
(models/mcore/hybrid.py: MambaLayer with our Mamba2 mixer, attention / MLP / MoE layers).

Tensor parallelism (parallel.tp > 1): megatron-core's parallel state gets
tensor_model_parallel_size = tp over our mesh's tp groups (`ensure_parallel_state` checks they coincide), each
layer holds its rank's blocks of the converted weights as DTensors on the tp mesh (`tp_shard.py`), attention runs
on the rank's heads, and the layer takes / returns the whole sequence like our native tp layers (plain tp inside:
the local spec's torch RMSNorms refuse megatron-core's sequence parallelism). MoE layers are replicated over the
tp ranks, as the native MoE blocks are: megatron-core's MoELayer gets a tp group of size 1 (expert tensor
parallelism 1, `moe_layer.replicated_over_tp`) and runs whole on every tp rank; the Nemotron-H blocks split their
attention / MLP the same way and their Mamba2 mixers by heads (hybrid.py).

Context parallelism (parallel.cp > 1): the layers are split exactly as the native ones (`parallel_plan.py`,
`apply_cp`): every McoreDecoderLayer (dense or MoE) and every Nemotron-H attention / MLP / MoE block keeps its
rank's chunks of the pack and all-gathers its output; `apply_cp` sets `context_parallel`, passed to `attend`, as
for our own attention. The Mamba2 blocks (our mixer inside megatron-core's MambaLayer) run the whole sequence on
every cp rank, as native. A MoE layer routes only its rank's tokens, so its `[moe]` loads and auxiliary-loss
statistics are over the same tokens as the native block's (summed over the ranks by the balancer). With tp > 1
too, the cp split encloses the layer's tp split (MoE layers replicated over tp). cp with ep > 1 is refused for
both backends (config validation).

Expert parallelism (parallel.ep > 1, MoE decoders and the Nemotron-H hybrid's MoE blocks): megatron-core's
parallel state gets
expert_model_parallel_size = ep over our ep mesh's groups (checked), the MoE layers use its all-to-all token
dispatcher and hold their rank's experts as DTensors on the ("ep_replicate", "ep") mesh (`ep_shard.py`). With
tp > 1 as well, our ep groups (ranks of one tp coordinate) are given to the MoE layers directly (megatron-core
builds its expert groups from consecutive ranks; `ensure_parallel_state`), which are replicated over tp.

Pipeline parallelism (parallel.pp > 1, SFT with data parallelism only, as native): `use_mcore_layers` runs on
the whole loaded model first, then `parallel.pipeline.split_model_for_stage` replaces the layers of other stages
by stubs; a held layer keeps its global index, megatron-core layer_number (index + 1) and parameter names, so
checkpoint keys equal pp = 1's. Our 1F1B schedule sends the activations between stages: megatron-core's
parallel state keeps pipeline_model_parallel_size = 1 (the layers need no pipeline groups). `native_state_dict`
needs the layer objects, so for the HF export each stage converts its own layers before the gather
(`PipelineStageModel.full_state_dict(stage_transform)`).

LoRA (`[lora]`): the adapters are applied to the native model before the swap (training/lora.py: target selection
by PEFT names, `init_from`, merge — all unchanged), and each McoreDecoderLayer takes over its native layer's
adapter factors (the same Parameters, `LoRAAdapter.of`) under the native names (`self_attn.q_proj.lora_A.weight`
...), so checkpoints, the PEFT adapter file, the merged export and `lora_disabled` (GRPO's reference) see what
they see with the native backend; the base weights of the megatron-core layer are frozen as the native ones were
(`use_mcore_layers`, every block kind). Why the update is added to slices of the fused outputs rather than by
wrapping megatron-core's linears: the forward is composed here anyway, and this keeps the fused GEMMs and the
converted weights untouched. q / k / v: `linear_qkv`'s output split per query group as megatron-core splits it,
each adapter's update added to its slice (heads in native order) before QK-norm and rotary — where the native
q_proj / k_proj / v_proj outputs are; gate / up: `linear_fc1`'s halves before SwiGLU; o_proj / down_proj: added to
`linear_proj` / `linear_fc2`'s outputs. The adapters run in the native call order, so dropout masks match. With
adapters the layer uses megatron-core's local spec (TE's fused norm + linear keeps the normed input that the
adapters read inside). Adapted: attention q/k/v/o of every decoder layer and the dense SwiGLU MLPs; MoE layers'
routed experts are grouped weights, never adapted (as native); a LoRA on any other layer (a Nemotron-H block:
native target selection finds no PEFT names there either) is refused (McoreBackendError). Works with dp, cp, ep
pp, and tp (tests/integration/parallel/test_mcore_lora_parallel.py against native LoRA). With tp > 1 the layout
is Megatron's, as the native backend's (parallel/lora_tp.py), computed on local blocks: each factor is whole on
every tp rank (`Replicate`: checkpoints and the adapter file see the global factors) and its gradient summed
over tp (`Partial`, as the QK-norms'); a column-parallel target (q / k / v, gate / up) reads the whole input
with the whole A and this rank's rows of B, its input gradient all-reduced over tp (megatron-core's
linear_qkv / linear_fc1 all-reduce only their own); a row-parallel one (o / down) this rank's columns of A
and the whole B, its partial update all-reduced (linear_proj / linear_fc2 reduced their output inside).

Limits, refused with exit 2 before a run starts (config/sections.py, config/mode_keys.py, `check_mcore_model`,
`use_mcore_layers`): pipeline parallelism with tp / cp / ep > 1 (as for the native backend), a tp that does not
divide a layer's heads / groups / MLP width (TPError), MoE routing features megatron-core cannot express
(moe_layer.py), `[lora]` on a layer the megatron-core layer does not adapt (above); experimental:
not yet run on a GPU.
"""
from __future__ import annotations

import importlib.util
import logging
import re
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

from megatron_vlm import kernels
from megatron_vlm.kernels.availability import import_error
from megatron_vlm.models.common.attention import attend
from megatron_vlm.models.common.decoder import DecoderLayer
from megatron_vlm.models.common.lora import LORA_KEY_PARTS, LoRAAdapter, lora_modules
from megatron_vlm.models.common.mlp import SwiGLUMLP
from megatron_vlm.models.common.moe import MoE
from megatron_vlm.models.mcore.convert import hf_to_mcore, mcore_to_hf
from megatron_vlm.models.mcore.ep_shard import distribute_expert_params, global_to_full_experts, shard_expert_state
from megatron_vlm.models.mcore.errors import McoreBackendError
from megatron_vlm.models.mcore.hybrid import McoreHybridBlock, check_hybrid_block, is_hybrid_block
from megatron_vlm.models.mcore.moe_layer import check_decoder_moe, moe_config_kwargs
from megatron_vlm.models.mcore.parallel_state import ensure_parallel_state
from megatron_vlm.models.mcore.tp_shard import (
    distribute_layer_params,
    global_to_full,
    load_local_state,
    local_params,
    shard_layer_state,
)
from megatron_vlm.parallel.tensor_parallel import check_tp_sizes

__all__ = ["McoreDecoderLayer", "McoreBackendError", "use_mcore_layers", "native_state_dict", "check_mcore_model",
           "ensure_parallel_state"]

logger = logging.getLogger(__name__)
_WRAPPED = re.compile(r"^(?P<pre>.*\blayers\.(?P<i>\d+)\.)mcore\.(?P<name>.+)$")


_ATTN_LORA = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_MLP_LORA = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _check_lora(i: int, layer: nn.Module, adaptable: tuple[str, ...]) -> None:
    """Every LoRA adapter of native layer `i` must be one the megatron-core layer applies (McoreBackendError)."""
    other = sorted(set(lora_modules(layer)) - set(adaptable))
    if other:
        can = ", ".join(n.rsplit(".", 1)[-1] for n in adaptable) or "none"
        raise McoreBackendError(f"lora.target_modules: adapts language_model.layers.{i}.{other[0]}, which "
                                f"parallel.backend = 'mcore' does not adapt in this layer (adaptable here: {can}); "
                                "narrow lora.target_modules or use parallel.backend = 'native'")


def _check_layer(i: int, layer: nn.Module) -> None:

    if is_hybrid_block(layer):
        _check_lora(i, layer, ())
        return check_hybrid_block(i, layer)
    if not isinstance(layer, DecoderLayer) or not isinstance(layer.mlp, (SwiGLUMLP, MoE)):
        kind = type(layer.mlp).__name__ if isinstance(layer, DecoderLayer) else type(layer).__name__
        raise McoreBackendError(f"parallel.backend = 'mcore': decoder layer {i} is a {kind}; only attention + SwiGLU "
                                "or MoE layers and Nemotron-H blocks are built from megatron-core")
    if isinstance(layer.mlp, MoE):

        check_decoder_moe(layer.mlp)
    _check_lora(i, layer, _ATTN_LORA if isinstance(layer.mlp, MoE) else _ATTN_LORA + _MLP_LORA)
    attn = layer.self_attn
    if attn.o_proj.bias is not None:
        raise McoreBackendError("parallel.backend = 'mcore': an output-projection bias is not mapped")
    if attn.q_norm is not None and not attn.qk_norm_per_head:
        raise McoreBackendError("parallel.backend = 'mcore': QK-norm over the full width is not mapped (per head only)")


def check_mcore_model(model: nn.Module) -> None:
    """Raise McoreBackendError when `model`'s language decoder cannot be built from megatron-core layers."""
    layers = getattr(getattr(model, "language_model", None), "layers", None)
    if layers is None:
        raise McoreBackendError(f"parallel.backend = 'mcore': {type(model).__name__} has no language_model.layers")
    for i, layer in enumerate(layers):
        _check_layer(i, layer)


def _config(layer: DecoderLayer, num_layers: int, dtype: torch.dtype, tp: int = 1, ep: int = 1):
    """Plain tensor parallelism under tp > 1 (sequence_parallel=False; our native tp's sequence-parallel norms
    have no counterpart here): megatron-core's local layer spec builds torch RMSNorms, which refuse sequence
    parallelism (`WrappedTorchNorm`), and its sequence-parallel gathers allocate their buffers on CUDA
    (`torch.cuda.current_device()`), so that path could not run, nor be tested, on the CPU. The layer runs
    the whole sequence: norms replicated, one all-reduce after the attention and one after the MLP."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    attn = layer.self_attn
    heads, kv_heads = attn.local_heads()
    moe = _moe_fields(layer.mlp)
    if ep > 1:  # each rank holds E / ep experts; tokens travel to them with all-to-alls
        moe["moe_token_dispatcher_type"] = "alltoall"
    return TransformerConfig(
        num_layers=num_layers, hidden_size=layer.input_layernorm.weight.shape[0],
        ffn_hidden_size=_ffn_hidden_size(layer.mlp), num_attention_heads=heads, num_query_groups=kv_heads,
        kv_channels=attn.head_dim, normalization="RMSNorm", layernorm_epsilon=layer.input_layernorm.eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=attn.q_proj.bias is not None, qk_layernorm=attn.q_norm is not None,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, use_cpu_initialization=True, perform_initialization=False,
        **moe, expert_model_parallel_size=ep, expert_tensor_parallel_size=1,  # MoE replicated over tp
        tensor_model_parallel_size=tp, sequence_parallel=False,
    )


def _tp_sizes(index: int, layer: nn.Module) -> dict[str, int]:
    """The sizes tensor parallelism splits in decoder layer `index` (a DecoderLayer or a Nemotron-H block), by
    the names `check_tp_sizes` reports: attention / KV heads, the dense MLP width, Mamba2 heads and groups (a MoE
    block is replicated over tp: nothing of it is split)."""
    where = f"language_model.layers.{index}"
    kind = getattr(layer, "block_type", None)
    if kind is None:  # DecoderLayer
        heads, kv_heads = layer.self_attn.local_heads()
        sizes = {f"{where}.num_attention_heads": heads, f"{where}.num_key_value_heads": kv_heads}
        if not isinstance(layer.mlp, MoE):
            sizes[f"{where}.intermediate_size"] = _ffn_hidden_size(layer.mlp)
        return sizes
    m = layer.mixer
    if kind == "full_attention":
        return {f"{where}.num_attention_heads": m.num_heads, f"{where}.num_key_value_heads": m.num_kv_heads}
    if kind == "mlp":
        return {f"{where}.intermediate_size": m.up_proj.weight.shape[0]}
    if kind == "linear_attention":
        return {f"{where}.mamba_num_heads": m.num_heads, f"{where}.n_groups": m.n_groups}
    return {}


def _ffn_hidden_size(mlp: nn.Module) -> int:
    return mlp.experts.down_proj.shape[-1] if isinstance(mlp, MoE) else mlp.gate_proj.weight.shape[0]


def _moe_fields(mlp: nn.Module) -> dict:
    """megatron-core's moe_* fields for a MoE block (moe_layer.py); none for a dense MLP."""
    if not isinstance(mlp, MoE):
        return {}

    return {k: v for k, v in moe_config_kwargs(mlp).items() if k.startswith("moe_") or k == "num_moe_experts"}


def _layer_spec(qk_layernorm: bool, *, local: bool = False):
    """Transformer Engine's spec when `transformer_engine.pytorch` imports (fused norm + linear), megatron-core's
    local one otherwise (and with `local`: LoRA adapters read the normed input, which TE's fused norm + linear
    keeps inside). A TE that is installed but does not load (built for another torch) is named in the log, once."""
    from megatron.core.models.gpt import gpt_layer_specs

    if not local and importlib.util.find_spec("transformer_engine") is not None:
        error = import_error("transformer_engine.pytorch")
        if error is None:
            return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm), True
        if error not in _TE_LOGGED:
            _TE_LOGGED.add(error)
            logger.warning("parallel.backend = 'mcore': Transformer Engine is installed but does not import (%s); "
                           "megatron-core's local layer spec is used", error)
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm), False


_TE_LOGGED: set = set()


class McoreDecoderLayer(nn.Module):
    """A `DecoderLayer` stand-in (same call signature) around a megatron-core TransformerLayer (`self.mcore`).

    With a `tp_mesh` of size tp > 1 the TransformerLayer is built with tensor_model_parallel_size = tp and holds
    this rank's blocks of the converted weights (`tp_shard.py`), as DTensors on `tp_mesh`; it takes and returns
    the whole sequence (the contract of our native tp layers), so the native vocab-parallel embedding / lm_head
    and the code between layers see what they expect."""

    context_parallel = None
    """Set by `parallel.context_parallel.apply_cp` (packed input then holds this rank's tokens); passed to `attend`."""
    tp_sharded_itself = True
    """`parallel.tensor_parallel.apply_tp` leaves this layer alone: megatron-core's linears split it."""

    def __init__(self, native: DecoderLayer, index: int, num_layers: int, tp_mesh=None, ep_mesh=None,
                 grad_divide_factor: float = 1.0) -> None:
        super().__init__()
        from megatron.core.transformer.spec_utils import build_module

        _check_layer(index, native)
        adapters = lora_modules(native)  # [lora]: applied to the native layer before the swap (training/lora.py)
        dtype = native.input_layernorm.weight.dtype
        self.tp = 1 if tp_mesh is None else tp_mesh.size()
        self.tp_rank = 0 if tp_mesh is None else tp_mesh.get_local_rank()
        self.is_moe = isinstance(native.mlp, MoE)
        # expert parallelism (MoE layers only; ep_shard.py): this rank holds experts ep_rank * E/ep ...
        self.ep = 1 if ep_mesh is None or not self.is_moe else ep_mesh.size(ep_mesh.ndim - 1)
        self.ep_rank = 0 if self.ep == 1 else ep_mesh.get_local_rank(ep_mesh.ndim - 1)
        if self.ep > 1 and native.mlp.num_experts % self.ep:
            raise McoreBackendError(f"parallel.ep = {self.ep}: decoder layer {index} has {native.mlp.num_experts} "
                                    "routed experts, not divisible by the expert-parallel size")
        config = _config(native, num_layers, dtype, self.tp, self.ep)
        if self.tp > 1:
            check_tp_sizes(self.tp, _tp_sizes(index, native))
        if self.is_moe:  # megatron-core's MoELayer, local spec (moe_layer.py)
            from megatron_vlm.models.mcore.moe_layer import moe_decoder_layer_spec

            ep_group = ep_mesh.get_group(ep_mesh.ndim - 1) if self.ep > 1 else None  # ours (ensure_parallel_state)
            spec, self.te_fused_norms = moe_decoder_layer_spec(config, expert_bias=False, ep_group=ep_group), False
        else:
            spec, self.te_fused_norms = _layer_spec(config.qk_layernorm, local=bool(adapters))
        self.heads = dict(num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_query_groups)
        self.head_dim = config.kv_channels
        self.mcore = build_module(spec, config=config, layer_number=index + 1)
        self.mcore.to(native.input_layernorm.weight.device)
        self.load_native({k: v for k, v in native.state_dict().items() if not _is_lora_key(k)})
        if self.ep > 1:  # the expert weights first: on the ep mesh, replicated over tp (left alone by the tp step)
            distribute_expert_params(self.mcore, ep_mesh, grad_divide_factor)
        if self.tp > 1:
            distribute_layer_params(self.mcore, tp_mesh)
        # the native LoRALinears' factors (the same Parameters), under the native names: self_attn.q_proj.lora_A...
        for part in ("self_attn", "mlp"):
            own = {n.split(".", 1)[1]: LoRAAdapter.of(m) for n, m in adapters.items() if n.startswith(part + ".")}
            if own:
                setattr(self, part, nn.ModuleDict(own))
        if self.tp > 1 and adapters:
            self._distribute_adapters(tp_mesh)

    def _distribute_adapters(self, mesh) -> None:
        """tp > 1: every adapter factor whole on each tp rank (`Replicate` on the tp mesh; the adapter file and
        checkpoints see the global factors), used in the forward as the local tensor (`local_params`) of which
        each rank reads its block (`_lora`), its gradient summed over the tp ranks (`Partial`, reduced by FSDP2)."""
        owners = self.mcore._mvlm_tp_owners  # distribute_layer_params
        for part in ("self_attn", "mlp"):
            for adapter in (getattr(self, part, None) or {}).values():
                for lin in (adapter.lora_A, adapter.lora_B):
                    p = lin.weight
                    lin.register_parameter("weight", nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()]),
                                                                  requires_grad=p.requires_grad))
                    owners.append((lin, "weight", [Partial()]))

    def load_native(self, state: dict) -> None:
        """Load a native DecoderLayer state dict (HF layer names, full tensors), converted exactly; this rank's
        blocks of it under tensor parallelism."""
        converted = hf_to_mcore({f"model.layers.0.{k}": v for k, v in state.items()}, te_fused_norms=self.te_fused_norms,
                                **self.heads)
        full = {k.removeprefix("decoder.layers.0."): v for k, v in converted.items()}
        local = shard_layer_state(full, self.tp, self.tp_rank) if self.tp > 1 else full
        if self.ep > 1:
            local = shard_expert_state(local, self.ep, self.ep_rank)
        missing, unexpected = load_local_state(self.mcore, local)  # after distribute_layer_params: into the blocks
        if missing or unexpected:
            raise McoreBackendError(f"megatron-core layer: weights missing {missing}, unexpected {unexpected}")

    def native_state(self, state: Optional[dict] = None) -> dict:
        """This layer's weights under native DecoderLayer (HF layer) names, full tensors. `state`: the
        megatron-core layer's state (or gradients) as global tensors (a DTensor's full tensor: the rank blocks
        concatenated, `tp_shard.global_to_full`); None = this layer's own (gathered over tp: collective)."""
        if state is None:
            state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in self.mcore.state_dict().items()}
        else:
            state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
        state = global_to_full_experts({k: v for k, v in state.items() if not k.endswith("_extra_state")}, self.ep)
        state = global_to_full(state, self.tp)
        hf = mcore_to_hf({f"decoder.layers.0.{k}": v for k, v in state.items()}, te_fused_norms=self.te_fused_norms,
                         **self.heads)
        return {k.removeprefix("model.layers.0."): v for k, v in hf.items()}

    @local_params
    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        cu_seqlens: Optional[torch.Tensor] = None,
        max_seqlen: Optional[int] = None,
        key_padding_mask: Optional[torch.Tensor] = None,
        kv_cache=None,
        layer_idx: Optional[int] = None,
        prefix_layout=None,
    ) -> torch.Tensor:
        layer = self.mcore
        packed = x.dim() == 2  # [T, hidden] with cu_seqlens; megatron-core's linears take 3-D input

        def three_d(t):
            return t[None] if packed else t

        def caller(t):  # back to the caller's layout; the residual adds below make fresh (non-view) outputs
            return t[0] if packed else t

        q, k, v = self._qkv(layer.input_layernorm(three_d(x)))  # + QK-norm
        out = attend(caller(q), caller(k), caller(v), cos, sin, causal=True, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                     key_padding_mask=key_padding_mask, kv_cache=kv_cache, layer_idx=layer_idx, prefix_layout=prefix_layout,
                     context_parallel=self.context_parallel)
        flat = three_d(out.reshape(*out.shape[:-2], -1))
        proj, bias = layer.self_attention.linear_proj(flat)
        proj = self._lora("self_attn", "o_proj", proj, flat)
        h = x + caller(proj) if bias is None else x + caller(proj) + bias
        mlp_out, bias = self._mlp(layer.pre_mlp_layernorm(three_d(h)))
        return h + caller(mlp_out) if bias is None else h + caller(mlp_out) + bias

    def _lora(self, part: str, name: str, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`out` (a slice of a fused projection's output, [..., heads, head_dim] or [..., width]) plus the LoRA
        update of the native projection `part.name` for input `x`, where that layer has an adapter."""
        adapters = getattr(self, part, None)
        if adapters is None or name not in adapters:
            return out
        adapter = adapters[name]
        if self.tp == 1:
            return adapter.add_lora(out.flatten(x.dim() - 1), x).view_as(out)
        if not adapter.lora_enabled:
            return out
        # tp > 1, Megatron's layout: column-parallel targets (q / k / v / gate / up: `out` holds this rank's rows)
        # read the whole input with the whole A and this rank's rows of B, the input's gradient summed over tp as
        # megatron-core's linear sums its own; row-parallel ones (o / down: `x` holds this rank's columns) this
        # rank's columns of A and the whole B, the partial update summed over tp (megatron-core's linear has
        # reduced its output already)
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region

        flat = out.flatten(x.dim() - 1)
        a, b = adapter.lora_A.weight, adapter.lora_B.weight
        row = name in ("o_proj", "down_proj")
        if row:
            a = a.chunk(self.tp, dim=1)[self.tp_rank]
        else:
            b = b.chunk(self.tp, dim=0)[self.tp_rank]
            x = copy_to_tensor_model_parallel_region(x)
        delta = F.linear(F.linear(adapter.lora_dropout(x.to(a.dtype)), a), b) * adapter.scaling
        if row:
            delta = reduce_from_tensor_model_parallel_region(delta)
        return (flat + delta.to(flat.dtype)).view_as(out)

    def _qkv(self, hn: torch.Tensor):
        """Query, key, value ([s, b, heads, head_dim], QK-normed) of the normed input `hn`: megatron-core's own
        split of `linear_qkv`'s per-group interleaved output, or, with q / k / v adapters, that split, the LoRA
        updates added where the native q_proj / k_proj / v_proj outputs are (before QK-norm), then QK-norm."""
        attn = self.mcore.self_attention
        adapters = getattr(self, "self_attn", None)
        if adapters is None or not any(n in adapters for n in ("q_proj", "k_proj", "v_proj")):
            return attn.get_query_key_value_tensors(hn)
        mixed, sizes = attn.get_query_key_value_tensors(hn, split_qkv=False)  # [s, b, groups, (q/g + 2) * head_dim]
        q, k, v = torch.split(mixed, sizes, dim=3)
        q = q.reshape(q.size(0), q.size(1), -1, self.head_dim)  # the groups' heads in native order
        q, k, v = (self._lora("self_attn", f"{n}_proj", t, hn) for n, t in zip("qkv", (q, k, v)))  # native call order
        if attn.q_layernorm is not None:
            q = attn.q_layernorm(q)
        if attn.k_layernorm is not None:
            k = attn.k_layernorm(k)
        return q, k, v

    def _mlp(self, hn: torch.Tensor):
        """(output, bias) of the MLP for the normed input `hn`: megatron-core's MLP / MoELayer, or, with dense-MLP
        adapters, `linear_fc1` split into gate | up (+ their LoRA updates), SwiGLU, `linear_fc2` (+ down_proj's)."""
        mlp = self.mcore.mlp
        if getattr(self, "mlp", None) is None:
            return mlp(hn)
        fc1, bias = mlp.linear_fc1(hn)
        if bias is not None:
            fc1 = fc1 + bias
        gate, up = torch.chunk(fc1, 2, dim=-1)
        gate, up = self._lora("mlp", "gate_proj", gate, hn), self._lora("mlp", "up_proj", up, hn)
        inter = kernels.swiglu(gate, up)
        out, bias = mlp.linear_fc2(inter)
        return self._lora("mlp", "down_proj", out, inter), bias

    def local_heads(self) -> tuple[int, int]:
        """(query heads, KV heads) this rank computes: the KV cache holds these."""
        return self.heads["num_attention_heads"] // self.tp, self.heads["num_key_value_heads"] // self.tp


def _is_lora_key(name: str) -> bool:
    return any(p in f".{name}" for p in LORA_KEY_PARTS)


def use_mcore_layers(model: nn.Module, tp_mesh=None, ep_mesh=None, grad_divide_factor: float = 1.0) -> None:
    """Replace every language-decoder layer of `model` (weights loaded) by a McoreDecoderLayer (a
    McoreHybridBlock for Nemotron-H blocks); `tp_mesh`: the world mesh's "tp" dim when parallel.tp > 1
    (collective then: every rank calls it; attention / MLP / Mamba2 split, MoE replicated). `ep_mesh`: the ("ep_replicate", "ep")
    mesh when parallel.ep > 1 (collective; MoE decoders, Nemotron-H MoE blocks): each MoE layer holds its rank's experts
    (ep_shard.py), their gradient divided by `grad_divide_factor` (the data-parallel size)."""

    check_mcore_model(model)
    layers = model.language_model.layers
    if ep_mesh is not None:  # before any collective: the refusal is the same on every rank
        ep = ep_mesh.size(ep_mesh.ndim - 1)
        if not any(isinstance(getattr(layer, "mlp", None), MoE) or getattr(layer, "block_type", None) == "moe"
                   for layer in layers):
            raise McoreBackendError(f"parallel.ep = {ep}: the model has no MoE layers to shard")
    if tp_mesh is not None:  # before any collective: the refusal (TPError, exit 2) is the same on every rank
        for i, layer in enumerate(layers):
            check_tp_sizes(tp_mesh.size(), _tp_sizes(i, layer))
    ensure_parallel_state(tp_mesh, ep_mesh)
    for i in range(len(layers)):
        # base weights frozen in the native layer ([lora]: all of them) stay frozen in the megatron-core one
        frozen = not any(p.requires_grad for n, p in layers[i].named_parameters() if not _is_lora_key(n))
        if is_hybrid_block(layers[i]):
            layers[i] = McoreHybridBlock(layers[i], i, model.language_model.args, tp_mesh=tp_mesh, ep_mesh=ep_mesh,
                                         grad_divide_factor=grad_divide_factor)
        else:
            layers[i] = McoreDecoderLayer(layers[i], i, len(layers), tp_mesh=tp_mesh, ep_mesh=ep_mesh,
                                          grad_divide_factor=grad_divide_factor)
        if frozen:
            for n, p in layers[i].named_parameters():
                if not _is_lora_key(n):
                    p.requires_grad_(False)


def native_state_dict(state: dict, model: nn.Module) -> dict:
    """A full state dict of `model` (keys relative to it) -> native DecoderLayer names for its
    McoreDecoderLayers (what the HF export maps); the same dict when it has none."""

    layers = getattr(getattr(model, "language_model", None), "layers", [])
    swapped = {f"language_model.layers.{i}.mcore.": layer for i, layer in enumerate(layers)
               if isinstance(layer, (McoreDecoderLayer, McoreHybridBlock))}
    if not swapped:
        return state
    out: dict[str, torch.Tensor] = {}
    grouped: dict[str, dict[str, torch.Tensor]] = {pre: {} for pre in swapped}
    for key, value in state.items():
        m = _WRAPPED.match(key)
        pre = m.group("pre") + "mcore." if m else None
        if pre in grouped:
            grouped[pre][m.group("name")] = value
        else:
            out[key] = value
    for pre, layer_state in grouped.items():
        if not layer_state:  # already under native names (a pipeline stage converted its own layers)
            continue
        native_pre = pre.removesuffix("mcore.")
        out.update({native_pre + k: v for k, v in swapped[pre].native_state(layer_state).items()})
    return out
