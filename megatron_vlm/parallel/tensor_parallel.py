"""Tensor parallelism (TP) of the language decoders on PyTorch DTensor (`torch.distributed.tensor.parallel`).

Why: a decoder layer of an 8B model no longer fits one device's activations and weights at long
sequence lengths even when FSDP shards the weights at rest; TP splits every layer's matmuls (and the
attention heads) over `tp` ranks, which then read the same data.

Layout (Megatron's, expressed with DTensor placements on the "tp" mesh dim):

* attention: q / k / v projections column-parallel (each rank holds `num_heads / tp` query heads and
  `num_kv_heads / tp` KV heads; `Attention` takes the head count from the projection outputs), o_proj
  row-parallel. Per-head QK-norm weights stay whole on every rank (each rank normalises its own heads),
  their gradient is summed over the tp ranks (`_partial_grad_params`).
* dense MLP: gate / up (or up alone) column-parallel, down row-parallel;
* sequence parallelism inside each decoder layer: the layer enters with the whole sequence, keeps only
  its tp rank's token shard (dim -2, `torch.chunk` sizes: any length works, a decode step of one token
  included), runs the norms and residual adds on the shard (norm weights whole, gradients summed over
  tp), all-gathers the shard before the attention / MLP and reduce-scatters their row-parallel output
  back to the shard (the all-reduce of plain TP, split in two with the norms in between), and leaves
  with the whole sequence again (all-gather). Between layers the stream is whole, so code that the
  family runs between layers (DeepStack's feature add) and masks over the whole sequence stay as they are;
* Mamba2 mixers: heads split as in Megatron (each tp rank runs `num_heads / tp` heads and their
  `n_groups / tp` B / C groups: its rows of in_proj, its conv channels, A / D / dt_bias and gated-norm
  groups, its columns of out_proj; `Mamba2Mixer.tp_shard`): the mixer gathers the sequence, its output is
  a partial sum reduce-scattered back to the shard, like attention's. The scan, the convolution and the
  projections' FLOPs and activations are divided by tp; the weights stay whole on every tp rank (in_proj
  interleaves z | xBC | dt rows, so a row split of the checkpoint tensor is not a head split), their
  gradient, non-zero on each rank's rows only, summed over tp (`_partial_grad_params`);
* MoE blocks (router, shared and routed experts) are replicated over the tp ranks:
  they gather the sequence, every tp rank computes them whole and keeps its shard of the output; their
  gradients are the same on every tp rank, so FSDP treats them as ordinary data-parallel parameters.
  With expert parallelism the routed experts are sharded by `apply_ep` over ep ranks of one tp coordinate;
* embedding: vocab-parallel (`Shard(0)` rows, masked lookup + all-reduce); lm_head: the same `Shard(0)`
  rows (tied or not); its logits are gathered over the vocabulary only for decoding, while training's
  token log-probs (`vocab_parallel_token_logprobs`) reduce a max, a sum of exponentials and the label's
  logit over the tp ranks instead of gathering `[N, vocab]`;
* LoRA adapters (`[lora]`, `LoRALinear`) on the column- / row-parallel projections are split as in
  Megatron (`lora_tp.py`): column-parallel, `lora_A` replicated and `lora_B` split on its output rows like
  the base weight; row-parallel, `lora_A` split on its input columns and `lora_B` replicated, its update a
  partial sum joining the base's before the reduce-scatter; the replicated factor's gradient is summed over
  tp. Inside a Mamba2 mixer the adapters of in_proj / out_proj follow the mixer's head split. The LM head
  and embedding are never adapted;
* vision towers and projectors are replicated: they are a small fraction of the FLOPs of a VLM step
  (InternViT-300M next to an 8B decoder; RADIO next to a 30B MoE), their sequence (patches) differs
  from the decoder's, and a replicated tower keeps `merge_vision_embeddings` a local scatter.

Numerics: every tp rank computes the same loss; TP changes only the order of the sums inside the
sharded matmuls, so losses agree with the dp-only run to fp32 rounding. Checkpoints are DCP over the
DTensors' global shapes, hence a checkpoint saved with tp=2 loads with any other layout.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from megatron_vlm.errors import ConfigError
from megatron_vlm.parallel.lora_tp import LoRAColwiseParallel, LoRARowwiseParallel, is_lora_linear

__all__ = ["apply_tp", "check_tp_sizes", "check_tp_divides", "decoder_tp_plan", "tp_sharded_numel", "TPError",
           "vocab_parallel_token_logprobs", "is_vocab_parallel"]


class TPError(ConfigError):
    """A size that the tensor-parallel degree does not divide (a configuration error: exit 2)."""


def check_tp_sizes(tp: int, sizes: dict[str, int]) -> None:
    """Raise `TPError` naming the first `key = value` of `sizes` that `parallel.tp` does not divide."""
    for key, value in sizes.items():
        if value % tp:
            raise TPError(f"parallel.tp={tp} does not divide {key}={value}: every tensor-parallel rank must "
                          "hold the same number of heads / columns / vocabulary rows")


def _is_lora(m: Optional[nn.Module]) -> bool:
    return is_lora_linear(m)


def _linear_plan(module: nn.Module, col: Iterable[str], row: Iterable[str]) -> dict:
    # row-parallel outputs stay Partial: the region's output hook reduce-scatters them over the sequence;
    # LoRA-adapted projections place their factors as Megatron does (parallel/lora_tp.py)
    plan = {name: (LoRAColwiseParallel if _is_lora(getattr(module, name)) else ColwiseParallel)()
            for name in col if getattr(module, name, None) is not None}
    plan.update({name: (LoRARowwiseParallel if _is_lora(getattr(module, name)) else RowwiseParallel)(
                     output_layouts=Partial(), use_local_output=False)
                 for name in row if getattr(module, name, None) is not None})
    return plan


# ---------------------------------------------------------------------------------------------------
# sequence parallelism inside each decoder layer


class _SeqState:
    """The token count of the sequence a decoder layer is running on (set by the layer's entry hook,
    read by its regions' hooks to give DTensor the global shape of an uneven sequence shard)."""

    length: int = 0


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(stride))


def _gather_seq(x: torch.Tensor, mesh: DeviceMesh, length: int) -> DTensor:
    """This rank's sequence shard (dim -2; torch.chunk sizes, possibly empty) -> the whole sequence,
    a Replicate DTensor (all-gather; backward: reduce-scatter of a Partial or slice of a Replicate grad)."""
    d = x.dim() - 2
    shape = list(x.shape)
    shape[d] = length
    return DTensor.from_local(x, mesh, [Shard(d)], run_check=False, shape=torch.Size(shape),
                              stride=_contiguous_stride(shape)).redistribute(placements=[Replicate()])


def _to_seq_shard(x) -> torch.Tensor:
    """A Replicate / Partial DTensor (or a whole-sequence tensor the same on every tp rank) -> this rank's
    sequence shard (a slice or a reduce-scatter)."""
    return x.redistribute(placements=[Shard(x.dim() - 2)]).to_local()


def _sequence_parallel_layer(layer: nn.Module, mesh: DeviceMesh, state: _SeqState) -> None:
    """The layer takes and returns the whole sequence (so code between layers, e.g. DeepStack, sees it)
    and runs on its tp rank's sequence shard inside: the norms and residual adds are sharded."""

    def enter(module, args, kwargs):
        x = args[0]
        state.length = x.shape[x.dim() - 2]
        local = _to_seq_shard(DTensor.from_local(x, mesh, [Replicate()], run_check=False))
        return (local, *args[1:]), kwargs

    def leave(module, args, kwargs, out):
        # a copy, not the view to_local() gives: the layer is an FSDP unit, whose output must not be a view
        return _gather_seq(out, mesh, state.length).to_local().clone()

    layer.register_forward_pre_hook(enter, with_kwargs=True)
    layer.register_forward_hook(leave, with_kwargs=True)


def _sequence_parallel_region(m: nn.Module, mesh: DeviceMesh, state: _SeqState, *, split: bool,
                              local_partial: bool = False) -> None:
    """Input: the sequence shard, all-gathered. `split` (attention / MLP): the row-parallel output is
    Partial and reduce-scattered to the shard; otherwise (a replicated block, every tp rank computing the
    whole sequence) the output is sliced to the shard. `local_partial` (a Mamba2 mixer running its own
    heads on plain tensors): the input is the local whole sequence, whose gradient is a partial sum over
    the tp ranks, and the output, a partial sum, is reduce-scattered to the shard."""
    grads = [Partial()] if local_partial else None

    def enter(module, args, kwargs):
        full = _gather_seq(args[0], mesh, state.length)
        return (full if split else full.to_local(grad_placements=grads), *args[1:]), kwargs

    def leave(module, args, kwargs, out):
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"tensor parallelism: {type(module).__name__} returned {type(out).__name__}, "
                            "expected one tensor")
        if not isinstance(out, DTensor):
            out = DTensor.from_local(out, mesh, [Partial() if local_partial else Replicate()], run_check=False)
        return _to_seq_shard(out)

    m.register_forward_pre_hook(enter, with_kwargs=True)
    m.register_forward_hook(leave, with_kwargs=True)


def _partial_grad_params(module: nn.Module, mesh: DeviceMesh, *, recurse: bool = False) -> None:
    """Make `module`'s parameters (and its children's when `recurse`) `Replicate` DTensors on the tp mesh
    whose forward uses the local tensor and whose gradient (different on each tp rank: each rank uses them
    on its own heads) is summed over the tp ranks (`Partial`), which FSDP2 reduces when it redistributes
    the gradient to `Replicate`."""
    owners = [(mod, n) for mod in (module.modules() if recurse else [module])
              for n, _ in mod.named_parameters(recurse=False)]
    for mod, name in owners:
        p = getattr(mod, name)
        mod.register_parameter(name, nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()]),
                                                  requires_grad=p.requires_grad))
    orig = module.forward

    @functools.wraps(orig)
    def forward(*args, _orig=orig, **kwargs):
        saved = [(mod, n, mod._parameters[n]) for mod, n in owners]
        try:
            for mod, n, p in saved:
                if isinstance(p, DTensor):
                    mod._parameters[n] = p.to_local(grad_placements=[Partial()])
            return _orig(*args, **kwargs)
        finally:
            for mod, n, p in saved:
                mod._parameters[n] = p

    module.forward = forward


def _is_attention(m: nn.Module) -> bool:
    return all(hasattr(m, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "num_kv_heads"))


def _is_dense_mlp(m: nn.Module) -> bool:
    return hasattr(m, "down_proj") and isinstance(m.down_proj, nn.Linear) and \
        isinstance(getattr(m, "up_proj", None), nn.Linear)


def _is_norm(m: nn.Module) -> bool:
    """A norm over the last dim (RMSNorm / LayerNorm: `eps`, a 1-D weight, no children)."""
    w = getattr(m, "weight", None)
    return hasattr(m, "eps") and w is not None and w.dim() == 1 and not list(m.children())


def _is_mamba2(m: nn.Module) -> bool:
    return all(hasattr(m, n) for n in ("in_proj", "conv1d", "out_proj", "A_log", "n_groups", "tp_shard"))


def _classify(m: nn.Module) -> str:
    if _is_attention(m):
        return "attention"
    if _is_mamba2(m):
        return "mamba2"
    if _is_dense_mlp(m):
        return "mlp"
    return "norm" if _is_norm(m) else "replicated"


def decoder_tp_plan(model: nn.Module, layer_children: Optional[dict[str, str]] = None) -> list[tuple[str, str, nn.Module]]:
    """(dotted name, kind, module) of every decoder-layer child: kind "attention" (heads split), "mlp"
    (columns split), "mamba2" (Mamba2 heads split), "norm" (runs on the sequence shard) or "replicated"
    (whole sequence on every tp rank, e.g. a MoE block). `layer_children`: child name -> kind or "auto" (classified
    by structure); children it does not name are "auto". Layers that split themselves (`tp_sharded_itself`:
    megatron-core layers, models/mcore/layer.py) are left out."""
    out = []
    for i, layer in enumerate(model.language_model.layers):
        if getattr(layer, "tp_sharded_itself", False):
            continue
        children = {n: "auto" for n, _ in layer.named_children()}
        children.update(layer_children or {})
        for child, kind in children.items():
            m = getattr(layer, child, None)
            if m is None:
                continue
            if kind == "auto":
                kind = _classify(m)
            if kind not in ("attention", "mlp", "mamba2", "norm", "replicated"):
                raise ValueError(f"tensor parallelism: unknown kind {kind!r} for language_model.layers.{i}.{child}")
            out.append((f"language_model.layers.{i}.{child}", kind, m))
    return out


def _check_module(tp: int, where: str, kind: str, m: nn.Module) -> None:
    if kind == "attention":
        check_tp_sizes(tp, {f"{where}.num_attention_heads": m.num_heads, f"{where}.num_key_value_heads": m.num_kv_heads})
        if m.q_norm is not None and not m.qk_norm_per_head:
            raise TPError(f"parallel.tp={tp}: {where} normalises q / k over all heads (qk_norm_per_head=False), "
                          "which needs every head on one rank")
    elif kind == "mlp":
        check_tp_sizes(tp, {f"{where}.intermediate_size": m.up_proj.out_features})
    elif kind == "mamba2":
        check_tp_sizes(tp, {f"{where}.mamba_num_heads": m.num_heads, f"{where}.n_groups": m.n_groups})


def check_tp_divides(model: nn.Module, tp: int, layer_children: Optional[dict[str, str]] = None) -> None:
    """Raise `TPError` naming the first size `tp` does not divide: the vocabulary, a layer's attention /
    KV heads, Mamba2 heads / groups or MLP width (works on a meta-device model: the `--check` planner calls it)."""
    if tp == 1:
        return
    check_tp_sizes(tp, {"vocab_size": model.lm_head.weight.shape[0]})
    for where, kind, m in decoder_tp_plan(model, layer_children):
        _check_module(tp, where, kind, m)


def tp_sharded_numel(module: nn.Module, layer_children: Optional[dict[str, str]] = None, *,
                     trainable: bool = False) -> int:
    """Parameters of `module` (a model or one of its decoder layers) that TP splits over the tp ranks
    (only those with requires_grad when `trainable`)."""
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def count(ps) -> int:
        return sum(p.numel() for p in ps if p.requires_grad or not trainable)

    total = 0
    if hasattr(module, "language_model"):
        plan = decoder_tp_plan(module, layer_children)
        total += count([module.lm_head.weight])
        emb = module._input_embeddings() if hasattr(module, "_input_embeddings") else None
        if emb is not None and emb.weight is not module.lm_head.weight:
            total += count([emb.weight])
    else:
        plan = [(n, _classify(m), m) for n, m in module.named_children()]
    for _, kind, m in plan:
        if kind not in ("replicated", "mamba2"):  # a Mamba2 mixer's weights stay whole (compute split only)
            for n in names:
                lin = getattr(m, n, None)
                if lin is None:
                    continue
                total += count(lin.parameters(recurse=False))
                if _is_lora(lin):  # the factor split like the base weight; the other one is replicated
                    total += count([(lin.lora_A if n in ("o_proj", "down_proj") else lin.lora_B).weight])
    return total


def apply_tp(model: nn.Module, mesh: DeviceMesh, *, layer_children: dict[str, str], embedding: str) -> None:
    """Shard `model`'s language decoder over the 1-D tp `mesh`, in place (see the module docstring).

    `layer_children`: for each decoder layer (`model.language_model.layers`), child name -> "attention",
    "mlp", "mamba2", "replicated" or "auto" (see `decoder_tp_plan`). `embedding`: the dotted name of the token
    embedding (vocab-parallel, as is `lm_head`). Raises `TPError` naming a size tp does not divide.
    """
    tp = mesh.size()
    if tp == 1:
        return
    check_tp_divides(model, tp, layer_children)
    states = {id(layer): _SeqState() for layer in model.language_model.layers}
    for layer in model.language_model.layers:
        if not getattr(layer, "tp_sharded_itself", False):  # megatron-core layers take / return the whole sequence
            _sequence_parallel_layer(layer, mesh, states[id(layer)])
    for where, kind, m in decoder_tp_plan(model, layer_children):
        state = states[id(model.language_model.layers[int(where.split(".")[2])])]
        if kind == "attention":
            parallelize_module(m, mesh, _linear_plan(m, ("q_proj", "k_proj", "v_proj"), ("o_proj",)))
            for norm in (m.q_norm, m.k_norm):
                if norm is not None:
                    _partial_grad_params(norm, mesh)
            m.tp_size = tp  # read by Attention.local_heads(): the KV cache holds this rank's heads
            _sequence_parallel_region(m, mesh, state, split=True)
        elif kind == "mlp":
            parallelize_module(m, mesh, _linear_plan(m, ("gate_proj", "up_proj"), ("down_proj",)))
            _sequence_parallel_region(m, mesh, state, split=True)
        elif kind == "mamba2":
            m.tp_shard(tp, mesh.get_local_rank())
            _partial_grad_params(m, mesh, recurse=True)
            _sequence_parallel_region(m, mesh, state, split=False, local_partial=True)
        elif kind == "norm":
            _partial_grad_params(m, mesh)
        else:
            _sequence_parallel_region(m, mesh, state, split=False)
    tied = model.lm_head.weight is model.get_submodule(embedding).weight
    parallelize_module(model, mesh, {
        embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        # decoding: logits gathered over the vocabulary; training uses `vocab_parallel_token_logprobs`
        "lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    })
    if tied:
        model.lm_head.weight = model.get_submodule(embedding).weight


# ---------------------------------------------------------------------------------------------------
# vocab-parallel token log-probs


def is_vocab_parallel(weight: torch.Tensor) -> bool:
    """True for an lm_head weight sharded by `apply_tp` (rows = vocabulary split over the tp ranks)."""
    return isinstance(weight, DTensor) and any(isinstance(p, Shard) and p.dim == 0 for p in weight.placements)


class _AllReduce(torch.autograd.Function):
    """Sum over the tp group; backward passes the gradient through (every tp rank computes the same
    loss from the sum, so the gradient of each rank's term is the gradient of the sum)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def vocab_parallel_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                                  temperature: float = 1.0, return_entropy: bool = False,
                                  chunk_size: Optional[int] = None, masked_token_ids: Sequence[int] = ()):
    """log p(labels) `[N]` fp32 (and entropy `[N]`) of softmax(hidden @ W^T / temperature) with W `[V, H]` a
    `Shard(0)` DTensor over the tp ranks; `hidden` `[N, H]` is the same on every tp rank.

    Each rank computes its `[rows, V / tp]` logits block (rows chunked by `chunk_size`); the softmax is
    combined with three all-reduces (max, sum of exponentials, the label's logit from the rank that owns
    it; and for the entropy the sum of p * z): the `[N, V]` logits are never gathered. Labels -100 give 0. The gradient of
    `hidden` is summed over the tp ranks (each holds the contribution of its vocabulary rows).
    `masked_token_ids`: ids removed from the softmax (the vision tokens the rollout engines never sample: the
    distribution they sample from, training/masked_vocab.py); each rank fills its own share of them."""
    mesh = weight.device_mesh
    tp_dim = next(i for i, p in enumerate(weight.placements) if isinstance(p, Shard) and p.dim == 0)
    group = mesh.get_group(tp_dim)
    tp, rank = mesh.size(tp_dim), mesh.get_local_rank(tp_dim)
    local_w = weight.to_local()
    vocab = weight.shape[0]
    start = rank * (vocab // tp)
    # identity forward, sum of the tp ranks' partial gradients backward
    h = DTensor.from_local(hidden, mesh, [Replicate()] * mesh.ndim, run_check=False).to_local(
        grad_placements=[Partial()] * mesh.ndim)
    n = h.shape[0]
    chunk = n if not chunk_size else max(1, int(chunk_size))
    masked = [int(i) - start for i in masked_token_ids if 0 <= int(i) - start < local_w.shape[0]]
    local_masked = torch.tensor(masked, dtype=torch.long, device=local_w.device) if masked else None
    logps, ents = [], []
    for s in range(0, max(n, 1), chunk):
        hc, lc = h[s:s + chunk], labels[s:s + chunk]
        z = (hc @ local_w.t()).float() / temperature                     # [rows, V / tp]
        if local_masked is not None:  # a finite fill: exp() is 0 and 0 * fill is 0 in the entropy (no NaN)
            z = z.index_fill(-1, local_masked, -1.0e30)
        m = z.detach().max(-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(z - m[:, None])
        total = _AllReduce.apply(e.sum(-1), group)
        local_label = lc - start
        own = (local_label >= 0) & (local_label < local_w.shape[0])
        picked = z.gather(-1, local_label.clamp(0, local_w.shape[0] - 1)[:, None])[:, 0] * own
        label_logit = _AllReduce.apply(picked, group)
        log_total = torch.log(total) + m
        logps.append((label_logit - log_total) * (lc != -100))
        if return_entropy:
            pz = _AllReduce.apply((e * z).sum(-1), group) / total
            ents.append(log_total - pz)
    logp = torch.cat(logps) if logps else hidden.new_zeros(0, dtype=torch.float32)
    if return_entropy:
        return logp, (torch.cat(ents) if ents else logp.new_zeros(0))
    return logp
