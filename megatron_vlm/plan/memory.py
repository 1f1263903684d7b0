"""Memory per rank of a run, estimated from a meta-device model and the config (no weights, no device).

Why: a run that cannot fit should fail in a second on a login node with the key to change, not after
an hour of queueing, loading and the first rollout. The estimate is deliberately simple and
conservative; the numbers it uses (all in bytes, per rank):

- F = FSDP shard size (`parallel.dp_shard`, -1 = world / (dp_replicate x tp)); P = parameters, T = trainable
  parameters (`train.train_layers`), m = bytes of `model.dtype` (the master weights the optimizer
  updates), c = bytes of the compute dtype (`train.precision`: bf16 = 2, fp32 = m (nothing cast: the weights' own); "auto" = bf16);
- tensor parallelism (`parallel.tp`): the parameters TP splits (attention and dense-MLP projections,
  embedding, lm_head: S of P, S_T of T) count S / tp per rank: P' = P - S + S / tp, likewise T';
- master weights (params)  = P' x m / F
- gradients                = T' x m / F
- AdamW states             = T' x 2 x o / F (exp_avg, exp_avg_sq; o = 4 bytes, 2 with `optimizer.moments_dtype =
  "bf16"`)
- with `parallel.fsdp = false` (one process): weights = P x c + T x m where c < m (bf16 weights, fp32 masters beside
  them), no gathered block;
- gathered block           = 2 x B' x c, B' = parameters of the largest transformer block, its TP-split
  part divided by tp (FSDP2 all-gathers one block for compute and prefetches the next);
- activations: t = `data.max_tokens_per_pack` tokens per micro-batch, L decoder layers, h = hidden
  size, and per layer per token a = 2h + 2 x (sum of out_features of the layer's nn.Linear modules)
  + per MoE block 2 x top_k x (expert up/gate rows + h): each projection's output and one elementwise
  result derived from it (attention core output, activation product, residual / norm) are kept for
  backward; routed experts see top_k copies of each token; with tp the column-parallel outputs
  (q / k / v, gate / up: `a_col` of a) count a_col / tp;
  without activation checkpointing: t x L x a x c;
  with (`train.activation_checkpointing` true / "full"): t x L x h x c (the saved block inputs) + t x a x c (one
  block recomputed at a time); "selective" (the matmul and attention outputs kept, the ops between them
  recomputed): t x L x (a / 2 + h) x c (a / 2 counts each projection's output once, h the block input);
  with `parallel.compile` too (or under FSDP2 with fp32 router units inside bf16 blocks: Nemotron-H), a block with
  a MoE or Mamba2 mixer is checkpointed per child and piece
  (parallel/apply.py `_splits`), whose checkpoints keep their inputs where the block-wide one recomputes
  them: + t x (s x c + s_b), summed over those layers per token s = h per norm child (its output) + per
  Mamba2 mixer its scan output (heads x head_dim) + per MoE block with latent projections its latent size,
  s_b = per MoE block top_k x (4 + 8) bytes (the fp32 routing weights and int64 expert ids);
  the vision tower's activations and the LM-head logits (the fused, vocabulary-chunked log-prob
  kernel) are not counted;
- rollout KV cache (GRPO) = 2 x (sum over attention layers of kv_heads x head_dim) x c x slots,
  slots = prompts per rollout batch x rl.batch.group_size x data.max_tokens_per_pack (see inference/kv_budget.py),
  or with a paged pool of fixed size slots = rl.rollout.kv_cache_blocks x rl.rollout.kv_block_size;
  each tp rank caches its kv_heads / tp.
  Rollout and training alternate (the cache is freed before the update), so the peak is
  static + rollout copy + max(activations, KV cache + routes buffer), static = master weights + gradients +
  AdamW + gathered block;
- expert parallelism (`parallel.ep` > 1): the routed experts (X of P, X_T of T) are not FSDP parameters but
  split over the ep ranks, so the master weights are (P' - X) x m / F + X x m / ep, likewise gradients and
  AdamW with T' and X_T;
- pipeline parallelism (`parallel.pp` > 1): a rank holds one stage (parallel/pipeline.py: decoder layers [lo, hi),
  the first stage also the embedding and the vision tower, the last the final norm and lm_head; a tied lm_head on
  both), so P and T are those of the stage with the most parameters; activations stay t x L x a x c (1F1B keeps
  up to pp micro-batches in flight on the first stage, each through its L / pp layers);
- evaluation (`train.mode = "eval"`, plan/check.py): no gradients or AdamW states (T = 0), the forward-only
  activations of one block (the checkpointed figure, conservative), and a KV cache of `eval.batch_size` prompts x
  max(1, `eval.samples`) completions x t slots;
- rollout copy (GRPO, `rl.rollout.weights`; held through the whole run): "shared" 0 (the trainer's
  parameters, gathered block by block), "copy" P x c, "expert_parallel" (P - X) x c + X x c / ep (the
  dense weights whole, this rank's experts: inference/ep_rollout.py). Asynchronous GRPO (`rl.allocation`): the
  training ranks hold no rollout copy nor KV cache; each rollout rank holds the whole policy in the compute dtype
  and its engine's KV pool + routes (or a vLLM engine's share), planned apart (plan/check.py rollout_rank_lines).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from megatron_vlm.inference.kv_budget import kv_elements_per_slot

__all__ = ["ModelShape", "MemoryPlan", "model_shape", "pipeline_stage_params", "estimate_memory", "GiB"]

GiB = 2**30


@dataclass
class ModelShape:
    params: int
    trainable: int
    largest_block: int
    """Parameters of the largest transformer block (the FSDP unit)."""
    layers: int
    hidden: int
    act_per_token_layer: int
    """Elements kept for backward per token per decoder layer (the largest layer), `a` above."""
    kv_per_slot: int
    """2 x sum over attention layers of kv_heads x head_dim."""
    tp_params: int = 0
    """Parameters tensor parallelism splits (S above)."""
    tp_trainable: int = 0
    """Trainable parameters tensor parallelism splits (S_T above)."""
    tp_largest_block: int = 0
    """Of `largest_block`, the parameters tensor parallelism splits."""
    act_col_per_token_layer: int = 0
    """Of `act_per_token_layer`, the elements of column-parallel outputs (a_col above)."""
    expert_params: int = 0
    """Parameters of the routed experts of every MoE block (X above)."""
    expert_trainable: int = 0
    """Of `expert_params`, those with requires_grad (X_T above)."""
    split_act_per_token: int = 0
    """Elements per token, all decoder layers, that selective checkpoints split under `parallel.compile` keep
    beyond block-wide ones (s above, `split_extra_per_token`)."""
    split_bytes_per_token: int = 0
    """Bytes per token of fixed-dtype tensors they keep besides (s_b above: routing weights and expert ids)."""


def _colwise_activation_elements(layer: nn.Module) -> int:
    """2 x out_features of the layer's column-parallel projections under tensor parallelism."""
    from megatron_vlm.parallel.tensor_parallel import decoder_tp_plan

    total = 0
    for _, kind, m in decoder_tp_plan(_Wrap(layer)):
        names = ("q_proj", "k_proj", "v_proj") if kind == "attention" else ("gate_proj", "up_proj") if kind == "mlp" else ()
        total += sum(2 * getattr(m, n).out_features for n in names if getattr(m, n, None) is not None)
    return total


class _Wrap:
    """A one-layer stand-in for a model (`language_model.layers`), to classify one layer's children."""

    def __init__(self, layer: nn.Module):
        self.language_model = type("LM", (), {"layers": [layer]})()


def _layer_activation_elements(layer: nn.Module, hidden: int) -> int:
    from megatron_vlm.models.common.moe import MoE

    total = 2 * hidden
    experts = set()
    for m in layer.modules():
        if isinstance(m, MoE):
            ex = m.experts
            experts.update(id(x) for x in ex.modules())
            up = ex.gate_up_proj if getattr(ex, "gated", False) else ex.up_proj
            total += 2 * m.gate.top_k * (up.shape[1] + hidden)
    for m in layer.modules():
        if isinstance(m, nn.Linear) and id(m) not in experts:
            total += 2 * m.out_features
    return total


def split_extra_per_token(layer: nn.Module, hidden: int) -> tuple[int, int]:
    """(elements in the compute dtype, bytes) per token that a decoder layer's selective checkpoint split under
    `parallel.compile` keeps beyond a block-wide one: (0, 0) for a layer that is not split.

    Split (parallel/apply.py `apply_compile`), each child and each piece of a MoE / Mamba2 mixer is a
    checkpoint of its own, keeping its inputs, which the block-wide checkpoint recomputed from the block input:
    a norm child's output (the next child's input); the routing weights (fp32) and expert ids (int64) the
    routed experts' checkpoint gets; a latent MoE's routed output (fc2_latent_proj's input); a Mamba2 mixer's
    scan output (its gated norm's input). The other inputs are the block input or matmul outputs, which
    selective checkpointing keeps anyway (a / 2)."""
    from megatron_vlm.models.common.mamba2 import Mamba2Mixer
    from megatron_vlm.models.common.moe import MoE
    from megatron_vlm.parallel.apply import _children_units, _opaque, _pieces, _splits

    if not _opaque(layer) or not _splits(layer):
        return 0, 0
    elements = nbytes = 0
    for child in _children_units(layer):
        if not _opaque(child) and not any(p.dim() >= 2 for p in child.parameters()):
            elements += hidden  # a norm
        if not _pieces(child):
            continue
        for m in child.modules():
            if isinstance(m, MoE):
                nbytes += m.top_k * (4 + 8)
                if m.fc2_latent_proj is not None:
                    elements += m.fc2_latent_proj.in_features
            elif isinstance(m, Mamba2Mixer):
                elements += m.intermediate_size
    return elements, nbytes


def model_shape(model: nn.Module) -> ModelShape:
    """Counts from a (meta-device) family model; trainable = parameters with requires_grad."""
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    from megatron_vlm.parallel.tensor_parallel import tp_sharded_numel

    blocks = model.transformer_blocks() if hasattr(model, "transformer_blocks") else []
    sizes = [(sum(p.numel() for p in b.parameters()), i) for i, b in enumerate(blocks)]
    largest, at = max(sizes, default=(params, -1))
    layers = list(model.language_model.layers)
    hidden = model.lm_head.weight.shape[1]
    act, big = max((_layer_activation_elements(layer, hidden), i) for i, layer in enumerate(layers))
    tp_params = tp_sharded_numel(model)
    from megatron_vlm.models.common.moe import moe_layers

    experts = [p for m in moe_layers(model) for p in m.experts.parameters()]
    split = [split_extra_per_token(layer, hidden) for layer in layers]
    return ModelShape(params=params, trainable=trainable, largest_block=largest, layers=len(layers), hidden=hidden,
                      act_per_token_layer=act, kv_per_slot=kv_elements_per_slot(model), tp_params=tp_params,
                      tp_trainable=tp_sharded_numel(model, trainable=True),
                      tp_largest_block=tp_sharded_numel(blocks[at]) if at >= 0 else 0,
                      act_col_per_token_layer=_colwise_activation_elements(layers[big]),
                      expert_params=sum(p.numel() for p in experts),
                      expert_trainable=sum(p.numel() for p in experts if p.requires_grad),
                      split_act_per_token=sum(e for e, _ in split), split_bytes_per_token=sum(b for _, b in split))


def pipeline_stage_params(model: Any, pp: int) -> list[tuple[int, int]]:
    """(parameters, trainable) held by each of the `pp` pipeline stages, as `split_model_for_stage` splits the
    model: decoder layers by `stage_layer_range`, the final norm and lm_head on the last stage, everything else
    (embedding, vision tower, projector) on the first; a tied lm_head is the embedding, held by both."""
    from megatron_vlm.parallel.pipeline import _final_norm_name, stage_layer_range

    lm = model.language_model
    n = len(lm.layers)
    where: dict[int, set[int]] = {}  # parameter id -> the stages that hold it
    for stage in range(pp):
        lo, hi = stage_layer_range(n, pp, stage)
        for layer in list(lm.layers)[lo:hi]:
            for p in layer.parameters():
                where.setdefault(id(p), set()).add(stage)
    for module in (getattr(lm, _final_norm_name(lm)), model.lm_head):
        for p in module.parameters():
            where.setdefault(id(p), set()).add(pp - 1)
    embed = model._input_embeddings().weight
    if model.lm_head.weight is embed:  # tied: the first stage's embedding and the last stage's head
        where[id(embed)] = {0, pp - 1}
    out = [[0, 0] for _ in range(pp)]
    for p in model.parameters():
        for s in where.get(id(p), {0}):
            out[s][0] += p.numel()
            out[s][1] += p.numel() if p.requires_grad else 0
    return [(a, b) for a, b in out]


@dataclass
class MemoryPlan:
    params: float
    grads: float
    optimizer: float
    gathered: float
    activations: float
    activations_no_ckpt: float
    activations_ckpt: float
    kv_cache: float
    rollout_prompts: int
    """Prompts per rollout batch on one rank (0 = not a GRPO run)."""
    rollout_copy: float = 0.0
    """The rollout engine's own weights (rl.rollout.weights), resident through the run."""
    activations_selective: float = 0.0
    """With train.activation_checkpointing = "selective"."""
    routes: float = 0.0
    """The rollout's device buffer of recorded MoE routes (plan/routes.py), next to the KV cache."""

    @property
    def static(self) -> float:
        return self.params + self.grads + self.optimizer + self.gathered

    @property
    def peak(self) -> float:
        return self.static + self.rollout_copy + max(self.activations, self.kv_cache + self.routes)


def moment_bytes(cfg: Any) -> int:
    """Bytes of each AdamW moment per trainable parameter (`optimizer.moments_dtype`: bf16 2, else 4)."""
    return 2 if getattr(cfg.optimizer, "moments_dtype", "fp32") == "bf16" else 4


def estimate_memory(shape: ModelShape, *, fsdp: int, master_bytes: int, compute_bytes: int, tokens: int,
                    activation_checkpointing: bool | str, rollout_prompts: int = 0, group_size: int = 0, tp: int = 1,
                    kv_slots: int = 0, ep: int = 1, rollout_weights: str = "shared", routes_bytes: float = 0.0,
                    moment_bytes: int = 4, compiled: bool = False, unsharded: bool = False) -> MemoryPlan:
    """The formulas of the module docstring; `rollout_prompts` 0 = no rollout (SFT); `kv_slots` > 0: the
    rollout cache's token positions when they are fixed (the paged pool, rl.rollout.kv_cache_blocks); `ep`:
    parallel.ep; `rollout_weights`: rl.rollout.weights (GRPO); `routes_bytes`: the routes' decode buffer;
    `activation_checkpointing`: train.activation_checkpointing (false, true / "full", "selective"); `moment_bytes`:
    bytes of each AdamW moment (optimizer.moments_dtype: fp32 4, bf16 2); `compiled`: parallel.compile, or FSDP2
    units of fp32 routers inside the blocks (under "selective" either splits the checkpoints of MoE / Mamba2 blocks); `unsharded`: parallel.fsdp = false (one process:
    the weights in the compute dtype, P x c, with the trainable ones' masters beside them, T x m, where c < m; no
    gathered block)."""
    from megatron_vlm.parallel.apply import ac_policy

    policy = ac_policy(activation_checkpointing)
    f = max(1, fsdp)
    keep = 1.0 - 1.0 / max(1, tp)  # the part of a TP-split quantity that lives on the other tp ranks
    params = shape.params - shape.tp_params * keep
    trainable = shape.trainable - shape.tp_trainable * keep
    if ep > 1:  # the experts split over ep ranks, not FSDP: counted as F-sharded below, so weight them f / ep
        params += shape.expert_params * (f / ep - 1)
        trainable += shape.expert_trainable * (f / ep - 1)
    copy = {"shared": 0.0, "copy": float(shape.params),
            "expert_parallel": shape.params - shape.expert_params + shape.expert_params / max(1, ep)}[rollout_weights]
    act = shape.act_per_token_layer - shape.act_col_per_token_layer * keep
    no_ckpt = tokens * shape.layers * act * compute_bytes
    ckpt = tokens * shape.layers * shape.hidden * compute_bytes + tokens * act * compute_bytes
    selective = tokens * shape.layers * (act / 2 + shape.hidden) * compute_bytes
    if compiled:
        selective += tokens * (shape.split_act_per_token * compute_bytes + shape.split_bytes_per_token)
    slots = kv_slots if kv_slots and rollout_prompts else rollout_prompts * group_size * tokens
    kv = shape.kv_per_slot * compute_bytes * slots / max(1, tp)
    weights = params * master_bytes / f
    if unsharded:
        weights = params * compute_bytes + (trainable * master_bytes if compute_bytes < master_bytes else 0.0)
    return MemoryPlan(
        params=weights,
        grads=trainable * master_bytes / f,
        optimizer=trainable * 2 * moment_bytes / f,
        gathered=0.0 if unsharded else 2 * (shape.largest_block - shape.tp_largest_block * keep) * compute_bytes,
        activations={None: no_ckpt, "full": ckpt, "selective": selective}[policy],
        activations_no_ckpt=no_ckpt,
        activations_ckpt=ckpt,
        activations_selective=selective,
        kv_cache=kv,
        rollout_prompts=rollout_prompts,
        rollout_copy=copy * compute_bytes if rollout_prompts else 0.0,
        routes=routes_bytes,
    )


def gib(x: float) -> str:
    return f"{x / GiB:.2f} GiB"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b) if b else 0

