"""Pipeline parallelism (`parallel.pp`): the language decoder's layers split into `pp` consecutive stages,
run by `torch.distributed.pipelining` (`PipelineStage` + `Schedule1F1B`).

Layout. Stage s holds decoder layers [lo_s, hi_s) (`stage_layer_range`: as even as possible, earlier
stages take the remainder). The first stage also holds everything before the decoder (token embedding,
vision tower, projector, DeepStack mergers), the last stage the final norm and `lm_head` and computes
the token log-probs (`TokenLogprobModel`, unchanged). `split_model_for_stage` removes what a stage does
not hold *in place* (stubs without parameters), so each stage's parameter names — and therefore its DCP
checkpoint keys and its part of the HF export — are the single-stage names: a pp=2 checkpoint resumes
with pp=1 (both stages' keys together are the full state).

Why a stage runs the family's own forward. The families' forwards differ (M-RoPE position ids, DeepStack,
Mamba2 / MoE blocks, packed `cu_seqlens`); instead of a second, per-family forward, every stage calls the
family forward with its stubs in place: the layers before the stage return the activation received from
the previous stage (`_StageInput`), the layers after it pass their input through (`_PassThrough`) and the
final norm is an identity before the last stage. What every stage recomputes from the micro-batch itself
is cheap and parameter-free (position ids, rotary tables, `cu_seqlens`); later stages do not get the
vision inputs (`_FIRST_STAGE_ONLY`), so the vision tower runs on the first stage only. DeepStack features
are added inside the first stage, so the first stage must hold the DeepStack layers (checked).

Why static shapes, padded. `PipelineStage` allocates its receive buffers once from the shapes it is
given, while packs differ in length; the activation sent between stages is the packed hidden states
[T, H] zero-padded to `data.max_tokens_per_pack` rows ([L, H]); the receiver keeps the first T rows (T is
known from its own copy of the micro-batch), so the padding never reaches a layer and carries no gradient.

Why 1F1B on CPU / gloo. `Schedule1F1B` keeps at most `pp` micro-batches' activations alive (GPipe keeps
all of them) and uses only point-to-point isend / irecv, which gloo implements; the interleaved schedules
need several stages per rank (`pp` x virtual stages <= layers), which the tiny test models (2-4 layers)
cannot give. Micro-batches are the gradient-accumulation micro-batches (`train.micro_batches_per_step`):
the schedule is driven with the packed list (`_step_microbatches`), not with a tensor it would split.

The loss stays the dp loss: the last stage returns -sum(log p) / global trained tokens x dp_size for each
micro-batch (gradients not rescaled by the schedule: `scale_grads=False`); the grad norm is the global
norm over all stages (`PipelineRunner.clip_grad_norm_`); a tied embedding / lm_head (held by the first
and the last stage) gets the sum of both stages' gradients and is counted once in the norm, so both copies
take the same optimizer step.

Why the loss stays on the device: on CUDA each read of a device value is a stream sync (the host waits for every
queued kernel). The last stage keeps each micro-batch's -sum(log p) as a device tensor, `run` sums them in
micro-batch order and all-reduces the sum over the stages without reading it, and the norm's clip leaves a
non-finite norm's gradients unscaled with `torch.where`: the step reads both once, in the SFT step's one read
(`training/sft.py` `global_loss_and_norm`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from megatron_vlm.data.batch import model_inputs
from megatron_vlm.parallel.grad import clip_grad_norm_
from megatron_vlm.parallel.mesh import LayoutError

__all__ = ["stage_layer_range", "check_pipeline_layout", "split_model_for_stage", "PipelineStageModel",
           "PipelineRunner", "stage_all_reduce", "stage_gather_objects"]

_FIRST_STAGE_ONLY = ("pixel_values", "pixel_values_videos")
"""Micro-batch entries only the first stage reads (the vision tower's input)."""


def stage_layer_range(num_layers: int, pp: int, stage: int) -> tuple[int, int]:
    """Decoder layers [lo, hi) of `stage` out of `pp`: sizes differ by at most one, earlier stages larger."""
    base, extra = divmod(num_layers, pp)
    lo = stage * base + min(stage, extra)
    return lo, lo + base + (1 if stage < extra else 0)


def _deepstack_levels(model: nn.Module) -> int:
    args = getattr(model, "args", None)
    vision = getattr(args, "vision", None)
    return len(getattr(vision, "deepstack_visual_indexes", None) or ())


def check_pipeline_layout(model: nn.Module, parallel_cfg, world_size: int) -> None:
    """LayoutError (exit 2) for a pipeline the model or the processes cannot form, naming key and numbers."""
    pp = parallel_cfg.pp
    if pp <= 1:
        return
    n = len(model.language_model.layers)
    if n < pp:
        raise LayoutError(f"parallel.pp ({pp}) is larger than the number of decoder layers ({n}): "
                          "every pipeline stage needs at least one layer")
    if world_size % pp:
        raise LayoutError(f"parallel.pp ({pp}) must divide the number of processes ({world_size})")
    for key in ("tp", "cp", "ep"):
        if getattr(parallel_cfg, key, 1) > 1:
            raise LayoutError(f"parallel.pp ({pp}) with parallel.{key} ({getattr(parallel_cfg, key)}): pipeline "
                              f"parallelism composes with data parallelism only; set parallel.{key} = 1")
    levels = _deepstack_levels(model)
    lo, hi = stage_layer_range(n, pp, 0)
    if levels > hi:
        raise LayoutError(f"parallel.pp ({pp}): the first stage holds {hi} of the {n} decoder layers, but the model "
                          f"adds DeepStack features after the first {levels}; use a smaller parallel.pp")
    idle = _stages_without_trainable(model, pp)
    if idle:
        lo, hi = stage_layer_range(n, pp, idle[0])
        raise LayoutError(f"parallel.pp ({pp}): pipeline stage {idle[0]} (decoder layers {lo}-{hi - 1}) holds no "
                          "trainable parameter (train.train_layers / [lora] train only other stages' parameters), and "
                          "every stage's ranks step an optimizer of their own; train a parameter of every stage, or "
                          "use a smaller parallel.pp")


def _stages_without_trainable(model: nn.Module, pp: int) -> list[int]:
    """The stages (`split_model_for_stage`'s split of the loaded, frozen model) that hold no parameter with
    requires_grad: decoder layers by `stage_layer_range`, the final norm and lm_head on the last stage (a tied
    lm_head on the first too), everything else on the first."""
    lm = model.language_model
    n = len(lm.layers)
    stage_of_layer = {i: s for s in range(pp) for i in range(*stage_layer_range(n, pp, s))}
    where: dict[int, set[int]] = {}
    for i, layer in enumerate(lm.layers):
        for p in layer.parameters():
            where[id(p)] = {stage_of_layer[i]}
    for mod in (getattr(lm, _final_norm_name(lm)), model.lm_head):
        for p in mod.parameters():
            where[id(p)] = {pp - 1}
    if model.lm_head.weight is model._input_embeddings().weight:
        where[id(model.lm_head.weight)] = {0, pp - 1}
    trained: set[int] = set()
    for p in model.parameters():
        if p.requires_grad:
            trained |= where.get(id(p), {0})
    return [s for s in range(pp) if s not in trained]


class _StageInput(nn.Module):
    """A decoder layer held by an earlier stage: returns the activation received from that stage, shaped as
    the hidden states this layer would have returned (the first rows of the padded [L, H] buffer)."""

    def __init__(self, owner: PipelineStageModel):
        super().__init__()
        self._owner = [owner]  # a list: not a submodule (no cycle in named_modules)

    def forward(self, x, *args, **kwargs):  # noqa: ARG002 - the layer's other inputs are not needed
        received = self._owner[0].received
        if received is None:
            raise RuntimeError("pipeline stage: no activation received for this micro-batch")
        rows = x.numel() // x.shape[-1]
        return received[:rows].reshape(x.shape).to(x.dtype)


class _PassThrough(nn.Module):
    """A decoder layer held by a later stage (or the final norm before the last stage): identity."""

    def forward(self, x, *args, **kwargs):  # noqa: ARG002
        return x


class _ZeroEmbedding(nn.Module):
    """The token embedding after the first stage: zeros of the right shape (overwritten by `_StageInput`).

    With a tied lm_head the last stage's stub keeps the tied weight as its `weight` (unused here: the head reads
    it), so that the weight's first name on that stage is the embedding's, as in the whole model: a one-stage
    checkpoint holds its optimizer state under that name only, and a pp > 1 run resuming it would otherwise ask
    for `lm_head.weight`'s state, which such a checkpoint does not have."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, tied_weight: Optional[nn.Parameter] = None):
        super().__init__()
        self.hidden_size, self.dtype = hidden_size, dtype
        if tied_weight is not None:
            self.weight = tied_weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*input_ids.shape, self.hidden_size, dtype=self.dtype, device=input_ids.device)


class _HeadStub(nn.Module):
    """`lm_head` before the last stage: only its dtype is read (by the vision path)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", torch.empty(0, dtype=dtype), persistent=False)


def _replace_child(root: nn.Module, target: nn.Module, new: nn.Module) -> None:
    for mod in list(root.modules()):
        for child_name, child in list(mod.named_children()):
            if child is target:
                setattr(mod, child_name, new)


def _final_norm_name(lm: nn.Module) -> str:
    for name in ("norm", "norm_f"):
        if isinstance(getattr(lm, name, None), nn.Module):
            return name
    raise LayoutError(f"parallel.pp: {type(lm).__name__} has no final norm (norm / norm_f) to place on the last stage")


class PipelineStageModel:
    """Mixed into the trainer's log-prob root (`TokenLogprobModel`, passed to `split_model_for_stage`: the
    parallel package does not import the training one) to make the FSDP root of one pipeline stage, with the
    same parameter names: `forward(x, batch=...)` is what `PipelineStage` calls per micro-batch. Non-last
    stages return their layers' output as a padded [L, H] buffer; the last stage returns the micro-batch's
    loss [1] (the base class's log-probs; their -sum is kept in `logp_sums`)."""

    def __init__(self, model: nn.Module, *, stage: int, num_stages: int, max_tokens: int, act_dtype: torch.dtype,
                 hidden_size: int, tied: bool, tied_shape: tuple):
        super().__init__(model)
        self.stage, self.num_stages = stage, num_stages
        self.max_tokens, self.act_dtype, self.hidden_size = max_tokens, act_dtype, hidden_size
        self.tied, self.tied_shape = tied, tied_shape
        self.received: Optional[torch.Tensor] = None
        self.loss_scale = 0.0
        self.logp_sums: list[torch.Tensor] = []

    def full_state_dict(self, stage_transform: Optional[Callable[[dict], dict]] = None) -> dict:
        """The full model's gathered CPU state dict on every rank (for the HF export; collective): each stage's
        entries, gathered over its data-parallel ranks, then over the pipeline group. (The one-stage
        `full_model_state_dict` keeps the values on global rank 0 only, which holds no later stage.)
        `stage_transform` maps each stage's own entries before the gather: what only the stage holding a layer
        can do (the megatron-core layers' conversion back to native names needs the layer objects, which the
        other stages replaced by stubs)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self, options=StateDictOptions(full_state_dict=True))
        sd = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}  # mcore: None extra state
        if stage_transform is not None:
            sd = stage_transform(sd)
        parts = [None] * self.num_stages
        dist.all_gather_object(parts, sd, group=self.pp_group)
        merged: dict = {}
        for part in parts:
            merged.update(part)
        return merged

    def optim_state_dict_for_save(self, optim_sd: dict) -> dict:
        """DCP writes one copy of the optimizer's `param_groups` (the same key on every rank), whose `params`
        list names the parameters of each group: on every stage it becomes the groups of all stages, merged by
        their hyperparameters (weight decay) in stage order, so that a checkpoint loaded with another layout
        (pp=1) finds every parameter in its group. Merged by hyperparameters, not by position: `train.train_layers`
        can leave a stage without the decayed or the non-decayed group (the optimizer drops empty groups).
        Collective over the stages."""
        mine = [({k: v for k, v in g.items() if k != "params"}, list(g["params"])) for g in optim_sd["param_groups"]]
        parts: list = [None] * self.num_stages
        dist.all_gather_object(parts, mine, group=self.pp_group)
        merged: list[dict] = []
        for s, part in enumerate(parts):
            for hyper, names in part:
                target = next((g for g in merged if {k: v for k, v in g.items() if k != "params"} == hyper), None)
                if target is None:
                    target = {**hyper, "params": []}
                    merged.append(target)
                # a tied lm_head is the first stage's embedding under a second name: listed once, as in one stage
                target["params"].extend(n for n in names if n not in target["params"]
                                        and not (self.tied and s > 0 and n.endswith("lm_head.weight")))
        # in the order a one-stage optimizer builds them (decayed first, training/optim.py), so a one-stage run that
        # loads the groups by position gets each its own hyperparameters whichever stage held a group first
        merged.sort(key=lambda g: float(g.get("weight_decay", 0.0)) <= 0.0)
        optim_sd["param_groups"] = merged
        return optim_sd

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def forward(self, x: Optional[torch.Tensor] = None, batch: Optional[dict] = None, **kwargs):
        if batch is None or kwargs:  # generation / evaluation paths: not through a pipeline
            raise RuntimeError("parallel.pp > 1 runs SFT training steps only (no evaluation or generation "
                               "through the pipeline)")
        if not self.is_first:
            self.received = x
            batch = {k: v for k, v in batch.items() if k not in _FIRST_STAGE_ONLY}
        try:
            if self.is_last:
                logp = super().forward(batch)
                self.logp_sums.append(-logp.detach().sum(dtype=torch.float64))  # on the device: no read
                return (-logp.sum(dtype=torch.float32) * self.loss_scale).reshape(1)
            hidden = self.model(**model_inputs(batch), return_hidden=True)
        finally:
            self.received = None
        flat = hidden.reshape(-1, hidden.shape[-1])
        if flat.shape[0] > self.max_tokens:
            raise ValueError(f"parallel.pp: a micro-batch of {flat.shape[0]} tokens exceeds data.max_tokens_per_pack "
                             f"({self.max_tokens}), the size of the activation sent between pipeline stages")
        if self.is_first and torch.is_grad_enabled() and self.training:
            flat = flat + self._anchor(flat).to(flat.dtype)  # every first-stage parameter gets a gradient (FSDP)
        out = flat.new_zeros(self.max_tokens, flat.shape[-1], dtype=self.act_dtype)
        return torch.cat([flat.to(self.act_dtype), out[flat.shape[0]:]], dim=0)


def split_model_for_stage(model: nn.Module, root_cls: type, *, stage: int, pp: int, max_tokens: int,
                          act_dtype: torch.dtype) -> nn.Module:
    """Keep in `model` only what `stage` holds (see the module docstring); returns the stage's root: a
    `root_cls` (the trainer's log-prob module) with `PipelineStageModel` mixed in. Call after the weights are
    loaded (and LoRA / freezing applied), before `parallelize`."""
    lm = model.language_model
    n = len(lm.layers)
    lo, hi = stage_layer_range(n, pp, stage)
    embed = model._input_embeddings()
    hidden, dtype = embed.weight.shape[-1], embed.weight.dtype
    tied = model.lm_head.weight is embed.weight
    cls = type(f"PipelineStage{root_cls.__name__}", (PipelineStageModel, root_cls), {})
    wrapper = cls(model, stage=stage, num_stages=pp, max_tokens=max_tokens, act_dtype=act_dtype,
                  hidden_size=hidden, tied=tied, tied_shape=tuple(embed.weight.shape))
    for i in range(n):
        if i < lo:
            lm.layers[i] = _StageInput(wrapper)
        elif i >= hi:
            lm.layers[i] = _PassThrough()
    if stage < pp - 1:
        setattr(lm, _final_norm_name(lm), _PassThrough())
        if not (tied and stage == 0):  # stage 0 keeps a tied head: it is its embedding, no extra weight
            model.lm_head = _HeadStub(act_dtype)  # the compute dtype (bf16 precision: FSDP casts real weights, not it)
    if stage > 0:
        # the last stage's tied head keeps its embedding name (see _ZeroEmbedding)
        _replace_child(model, embed, _ZeroEmbedding(hidden, dtype, embed.weight if tied and stage == pp - 1 else None))
        keep = {"language_model", "lm_head"}
        for name, _ in list(model.named_children()):
            if name not in keep:
                setattr(model, name, nn.Module())  # vision tower, projector: first stage only
        model._vision_blocks = lambda: []  # no vision blocks to checkpoint / shard on this stage
    return wrapper


class PipelineRunner:
    """One SFT step's forward / backward through the pipeline, and the cross-stage gradient bookkeeping."""

    def __init__(self, wrapper: PipelineStageModel, mesh, device: torch.device, n_microbatches: int):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        if n_microbatches < wrapper.num_stages:  # Schedule1F1B's own ValueError would be a traceback, not exit 2
            raise LayoutError(f"train.micro_batches_per_step ({n_microbatches}) must be at least parallel.pp "
                              f"({wrapper.num_stages}): the 1F1B schedule keeps every stage busy with a micro-batch of "
                              "its own; set train.micro_batches_per_step >= parallel.pp")
        self.wrapper = wrapper
        self.pp_group = wrapper.pp_group = mesh["pp"].get_group()
        self.device = device
        stage, pp = wrapper.stage, wrapper.num_stages
        act = torch.empty(wrapper.max_tokens, wrapper.hidden_size, dtype=wrapper.act_dtype, device="meta",
                          requires_grad=True)  # the activation and its gradient travel between stages
        first_in = torch.empty(1, device="meta")
        out = torch.empty(1, dtype=torch.float32, device="meta", requires_grad=True) if wrapper.is_last else act
        self.stage = PipelineStage(wrapper, stage, pp, device, input_args=(first_in if stage == 0 else act,),
                                   output_args=(out,), group=self.pp_group)
        self.schedule = Schedule1F1B(self.stage, n_microbatches, loss_fn=lambda out, target: out.sum(),  # noqa: ARG005
                                     scale_grads=False)
        self.n_microbatches = n_microbatches
        self._dummy = torch.zeros(1, device=device)
        # a stage between the two holders of a tied weight joins its gradient's all-reduce with zeros shaped like the
        # holders' FSDP2 shard of it on the same data-parallel coordinate: rows chunked over dp_shard (torch.chunk,
        # as fully_shard), whole over dp_replicate
        shard = mesh["dp_shard"]
        rows = torch.arange(wrapper.tied_shape[0]).chunk(shard.size()) if wrapper.tied_shape else ()
        r = shard.get_local_rank()
        self._tied_shard_shape = (int(rows[r].numel()) if r < len(rows) else 0, *wrapper.tied_shape[1:])

    def run(self, micro: list[dict], loss_scale: float) -> torch.Tensor:
        """Forward and backward of the step's micro-batches; the sum of -log p over them (float64, [1], on the
        device, not read), computed on the last stage and given to every stage (each stage's step guard then takes
        the same decision)."""
        if len(micro) != self.n_microbatches:
            raise ValueError(f"pipeline: {len(micro)} micro-batches, the schedule was built for {self.n_microbatches}")
        w = self.wrapper
        w.loss_scale, w.logp_sums = loss_scale, []
        self.stage.has_backward = True
        self.stage.clear_runtime_states()
        args = [(self._dummy,) if w.is_first else () for _ in micro]
        self.schedule._step_microbatches(args, [{"batch": m} for m in micro], [None] * len(micro), [])
        self._sum_tied_grad()
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for part in w.logp_sums:  # in micro-batch order, as a sum of the floats was: the same value
            total = total + part
        dist.all_reduce(total, group=self.pp_group)  # the other stages contribute 0
        return total

    def _tied_param(self):
        w = self.wrapper
        if not w.tied:
            return None
        if w.is_first:
            return w.model._input_embeddings().weight
        if w.is_last:
            return w.model.lm_head.weight
        return None

    def _sum_tied_grad(self) -> None:
        """A tied embedding / lm_head: both holders get the sum of the two stages' gradients."""
        if not self.wrapper.tied:
            return
        p = self._tied_param()
        if p is None or p.grad is None:
            local = None
            buf = torch.zeros(self._tied_shard_shape if p is None else _local_shape(p), device=self.device)
        else:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            buf = local.float().clone()
        dist.all_reduce(buf, group=self.pp_group)
        if p is not None:
            if local is None:
                p.grad = None  # no gradient reached this holder: nothing to take the sum into
                return
            local.copy_(buf)

    @torch.no_grad()
    def clip_grad_norm_(self, params: list, max_norm: float) -> torch.Tensor:
        """The global gradient norm over all stages (a tied weight counted once, on the first stage); the
        gradients of every stage scaled by the same coefficient."""
        tied = self._tied_param() if not self.wrapper.is_first else None
        counted = [p for p in params if p is not tied]
        local = clip_grad_norm_(counted, 0.0)
        sq = (local.to(self.device, torch.float64) ** 2).reshape(1)
        dist.all_reduce(sq, group=self.pp_group)
        total = sq.sqrt().to(torch.float32)[0]
        if max_norm > 0:  # a non-finite norm scales nothing (the step guard skips the step): no read to decide it
            coef = torch.where(torch.isfinite(total), torch.clamp(max_norm / (total + 1e-6), max=1.0),
                               torch.ones_like(total))
            for p in params:
                if p.grad is not None:
                    g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    g.mul_(coef.to(g.dtype))
        return total


def _local_shape(p) -> tuple:
    return tuple((p.to_local() if isinstance(p, DTensor) else p).shape)


def stage_gather_objects(mesh):
    """[obj of stage 0, obj of stage 1, ...] over this rank's pipeline group (picklable objects; collective over the
    stages): what only the stage holding a layer knows, such as its MoE layers' loads for a report of every layer."""
    size, group = mesh["pp"].size(), mesh["pp"].get_group()

    def gather(obj):
        out: list = [None] * size
        dist.all_gather_object(out, obj, group=group)
        return out
    return gather


def stage_all_reduce(mesh):
    """In-place SUM over the ranks of this rank's pipeline stage (its data-parallel ranks), for per-layer
    statistics such as the MoE loads: each stage holds different layers, so a sum over all ranks would mix
    tensors of different layers (and shapes)."""
    sub = mesh[("dp_replicate", "dp_shard", "cp", "tp")]
    if sub.size() == 1:
        return lambda t: t
    group = sub._flatten(mesh_dim_name="pp_stage_ranks").get_group()

    def reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=group)
        return t
    return reduce
