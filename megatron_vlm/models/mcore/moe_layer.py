"""megatron-core's `MoELayer` in place of our `MoE` block (models/common/moe.py) for `parallel.backend = "mcore"`.

What is megatron-core's and what is ours: routing is megatron-core's `TopKRouter` (its
`topk_routing_with_score_function`), tokens go through its "allgather" token dispatcher (ep = 1; with
parallel.ep > 1 its "alltoall" one, `alltoall_dispatcher`, each rank holding E / ep experts: ep_shard.py) into
`SequentialMLP` experts (megatron-core MLPs, one per expert) and its `SharedExpertMLP`; the math is chosen
from the native block's settings so it is the same function:

* Qwen3-MoE (softmax, top-k, renormalised when `norm_topk_prob`): megatron-core takes the top-k logits and
  the softmax over them (= renormalised top-k of the full softmax); without renormalisation
  `moe_router_pre_softmax` (softmax over all experts, then top-k);
* Nemotron-H / DeepSeek-V3 (sigmoid scores, score-correction bias for the choice only, group-limited
  selection, `routed_scaling_factor`, a shared expert, non-gated relu^2 experts): `moe_router_score_function
  = "sigmoid"`, the router's `expert_bias`, `moe_router_num_groups` / `moe_router_group_topk`,
  `moe_router_topk_scaling_factor`, `moe_shared_expert_intermediate_size`, `gated_linear_unit = False` with
  megatron-core's `squared_relu`.

Where the two differ, the model is refused (McoreBackendError, exit 2) naming the feature, never
approximated: megatron-core always renormalises sigmoid top-k weights when k > 1 and never when k = 1
(ours follows `norm_topk_prob`); its group score is the sum of the top `k / topk_group` scores of a
group (ours: the top two); its softmax router ignores an expert bias and scores groups on logits unless
pre-softmax; its latent projections (`moe_latent_size`) are Transformer Engine linears; the dispatcher
takes no expert biases (`mlp_bias`).

Three things are ours, in a subclass each (`_Router`, `_MoELayer`) and the router's top-k hook (`_RouteHook`):
* the router's gating linear runs where its weight is: megatron-core 0.16.1 moves a CPU router weight to
  `torch.cuda.current_device()` on every call and allocates the expert bias there, which cannot run on a
  CPU and would split the parameter from its optimizer state on a GPU; the logits are its
  `router_gating_linear` in fp32 (`moe_router_dtype = "fp32"`, as our router computes them) where
  Transformer Engine imports, else the same fp32 `F.linear` (without TE, 0.16.1's function refers to an
  undefined `te_general_gemm`);
* the load statistics our balancing policy reads (training/moe_balancing.py) — `expert_load`,
  `reset_expert_load`, `record_router_stats` / `router_stats`, `gate.e_score_correction_bias`, `top_k`,
  `num_experts` — fed from megatron-core's routing output (its routing map and the router logits), with
  the native block's counting rules (training forwards only, once under activation recomputation, padding
  excluded when a token mask is given). megatron-core's own auxiliary losses and expert-bias updates are
  off (`moe_router_load_balancing_type = "none"`): the `[moe]` policy drives both, as for native blocks,
  and moves the router's `expert_bias` in place;
* routing replay (models/common/routing_replay.py): megatron-core's routing function asks its router's
  `router_replay` object for the top-k (`topk_routing_with_score_function`); ours (`_RouteHook`, not megatron-core's
  `RouterReplay`, whose instances live in one process-wide list) records the ids it chose inside
  `recording_routes()` and, while `replaying_routes` has set the layer's `route_plan`, returns the recorded
  experts with megatron-core's own scores of them (`scores.gather`: the softmax over their logits, or their
  sigmoid scores without the expert bias), from which megatron-core then computes the gate weights as for its own
  choice (normalisation, scaling) — the native block's `weights_of`, so the router keeps its gradient.

megatron-core is imported only when a layer is built (`mcore_moe_classes`).
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_vlm.models.common.moe import MoE, RouterStats
from megatron_vlm.models.common.routing_replay import RoutePlan, record_routes
from megatron_vlm.models.mcore.errors import McoreBackendError

__all__ = ["moe_config_kwargs", "moe_layer_spec", "replicated_over_tp", "moe_decoder_layer_spec", "check_decoder_moe",
           "moe_to_mcore", "mcore_to_moe", "mcore_moe_classes"]


def _refuse(feature: str, why: str):
    return McoreBackendError(f"parallel.backend = 'mcore': MoE {feature} has no megatron-core equivalent ({why})")


def _activation(name: str):
    from megatron.core.activations import squared_relu

    acts = {"silu": F.silu, "relu2": squared_relu}
    if name not in acts:
        raise _refuse(f"activation {name!r}", "only SwiGLU (silu) and relu^2 experts are mapped")
    return acts[name]


def moe_config_kwargs(moe: MoE) -> dict[str, Any]:
    """TransformerConfig fields (moe_* and the experts' activation) that give `moe`'s routing and experts;
    McoreBackendError naming the feature when megatron-core cannot express it (module docstring)."""
    gate, experts = moe.gate, moe.experts
    k, n_experts = gate.top_k, gate.num_experts
    bias = gate.e_score_correction_bias is not None
    if moe.fc1_latent_proj is not None:
        raise _refuse("latent projections (moe_latent_size)", "megatron-core 0.16.1 builds them as Transformer Engine "
                      "linears only")
    if moe.fc2_latent_proj is not None or any(getattr(m, "bias", None) is not None for m in moe.modules()
                                              if isinstance(m, nn.Linear)):
        raise _refuse("linear biases (mlp_bias)", "megatron-core's token dispatcher takes no expert biases")
    kw: dict[str, Any] = dict(num_moe_experts=n_experts, moe_router_topk=k,
                              moe_ffn_hidden_size=experts.down_proj.shape[-1], moe_router_dtype="fp32",
                              moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                              moe_aux_loss_coeff=0.0, moe_grouped_gemm=False, moe_shared_expert_overlap=False,
                              gated_linear_unit=experts.gated, activation_func=_activation(_activation_name(experts)),
                              add_bias_linear=False)
    if gate.score_func == "sigmoid":
        if gate.norm_topk_prob != (k > 1):
            raise _refuse(f"sigmoid routing with norm_topk_prob={gate.norm_topk_prob} and top_k={k}",
                          "megatron-core renormalises sigmoid top-k weights exactly when top_k > 1")
        kw["moe_router_score_function"] = "sigmoid"
    else:
        if bias:
            raise _refuse("score-correction bias with softmax routing", "megatron-core's softmax router ignores it")
        if gate.n_group > 1 and gate.norm_topk_prob:
            raise _refuse("group-limited softmax routing with norm_topk_prob",
                          "megatron-core scores the groups on logits, not probabilities")
        kw.update(moe_router_score_function="softmax", moe_router_pre_softmax=not gate.norm_topk_prob)
    if gate.n_group > 1:
        group_size = n_experts // gate.n_group
        if k % gate.topk_group or k // gate.topk_group != min(2, group_size):
            raise _refuse(f"group-limited routing with top_k={k}, topk_group={gate.topk_group}, n_group={gate.n_group}",
                          "megatron-core scores a group by its top top_k/topk_group experts, ours by its top two")
        kw.update(moe_router_num_groups=gate.n_group, moe_router_group_topk=gate.topk_group)
    if gate.routed_scaling_factor != 1.0:
        kw["moe_router_topk_scaling_factor"] = float(gate.routed_scaling_factor)
    shared = moe.shared_experts
    if shared is not None:
        up, down = getattr(shared, "up_proj", None), getattr(shared, "down_proj", None)
        if not isinstance(up, nn.Linear) or not isinstance(down, nn.Linear) or hasattr(shared, "gate_proj") \
                or experts.gated or getattr(shared, "act", None) is not experts.act:
            raise _refuse(f"shared experts of type {type(shared).__name__}", "only a non-gated up / down shared expert "
                          "with the routed experts' activation (one megatron-core activation_func) is mapped")
        kw["moe_shared_expert_intermediate_size"] = up.weight.shape[0]
    return kw


def _activation_name(experts) -> str:
    from megatron_vlm.models.common.moe import _ACTIVATIONS

    for name, fn in _ACTIVATIONS.items():
        if fn is experts.act:
            return name
    return repr(experts.act)


@functools.cache
def mcore_moe_classes():
    """(router class, MoE layer class): megatron-core's TopKRouter / MoELayer with our two additions."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import router_gating_linear
    from megatron.core.transformer.moe.router import TopKRouter

    class _Router(TopKRouter):
        """TopKRouter whose gating runs on its weight's device; `expert_bias` (fp32) allocated there."""

        def __init__(self, config, pg_collection=None, *, expert_bias: bool = False):
            super().__init__(config=config, pg_collection=pg_collection)
            if expert_bias:  # megatron-core allocates it on the current CUDA device: ours follows the module
                del self.expert_bias
                self.register_buffer("expert_bias", torch.zeros(config.num_moe_experts, dtype=torch.float32,
                                                                device=self.weight.device))
            self.last_logits: Optional[torch.Tensor] = None
            self.router_replay = _RouteHook()  # megatron-core's routing asks it for the top-k (module docstring)

        def _apply(self, fn, recurse=True):
            # the expert bias stays fp32 whatever the model is cast to, as the native router's correction bias
            # (bias updates of ~1e-3 vanish in bf16); megatron-core restores it only at the next forward
            super()._apply(fn, recurse)
            bias = self.expert_bias
            if bias is not None and bias.is_floating_point() and bias.dtype != torch.float32:
                self.expert_bias = bias.float()
            return self

        def gating(self, input: torch.Tensor) -> torch.Tensor:
            from megatron.core.transformer.moe import moe_utils

            if getattr(moe_utils, "te_general_gemm", None) is not None:  # Transformer Engine's fp32 GEMM
                logits = router_gating_linear(input, self.weight, self.bias, torch.float32)
            else:  # the same fp32 linear; 0.16.1's own path names an undefined te_general_gemm without TE
                logits = F.linear(input.float(), self.weight.float(), None if self.bias is None else self.bias.float())
            self.last_logits = logits
            return logits

        @property
        def e_score_correction_bias(self) -> Optional[torch.Tensor]:
            """The native name the balancing policy updates in place."""
            return self.expert_bias

        @property
        def top_k(self) -> int:
            return self.topk

    # megatron-core's TransformerLayer passes its process groups only to the MoELayer class itself and logs
    # "Unknown MLP type" for any other MLP module, our subclass included (its groups come with the spec:
    # `moe_layer_spec`); the only MLP specs this project builds are megatron-core's and this subclass
    logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(
        lambda record: not record.getMessage().startswith("Unknown MLP type"))

    class _MoELayer(MoELayer):
        """megatron-core's MoELayer with the native `MoE` block's load-statistics interface."""

        reports_expert_load = True  # found by models.common.moe.moe_layers
        accepts_route_plan = True  # found by routing_replay.replaying_routes

        @property
        def route_plan(self) -> Optional[tuple[RoutePlan, int]]:
            return self.router.router_replay.plan

        @route_plan.setter
        def route_plan(self, value: Optional[tuple[RoutePlan, int]]) -> None:
            self.router.router_replay.plan = value

        def __init__(self, *args, **kwargs):
            with _alltoall_without_cuda():
                super().__init__(*args, **kwargs)
            if type(self.token_dispatcher) is alltoall_dispatcher().__mro__[1]:
                self.token_dispatcher.__class__ = alltoall_dispatcher()
            self.record_router_stats = False
            self.router_stats: Optional[RouterStats] = None
            self._expert_load: Optional[torch.Tensor] = None
            self._last_map: Optional[torch.Tensor] = None
            self.router.register_forward_hook(self._keep_map)

        def _keep_map(self, module, args, output):
            self._last_map = output[1]

        @property
        def gate(self):
            return self.router

        @property
        def num_experts(self) -> int:
            return self.config.num_moe_experts

        @property
        def top_k(self) -> int:
            return self.config.moe_router_topk

        @property
        def expert_load(self) -> torch.Tensor:
            device = self.router.weight.device
            if self._expert_load is None or self._expert_load.device != device:
                self._expert_load = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
            return self._expert_load

        def reset_expert_load(self) -> None:
            self.expert_load.zero_()

        def forward(self, hidden_states: torch.Tensor, *, token_mask: Optional[torch.Tensor] = None):
            """hidden_states [..., hidden] (megatron-core flattens the tokens in that order); `token_mask`
            (same leading shape, True = real token) excludes padding from `expert_load`."""
            out, bias = super().forward(hidden_states)
            logits, routing_map = self.router.last_logits, self._last_map  # logits [..., E] -> [N, E] as ours
            logits = logits.reshape(-1, logits.shape[-1])
            self.router.last_logits = self._last_map = None
            if self.training:
                # the scores (the auxiliary loss's input) are computed in every training forward, as the native
                # router's are: activation checkpointing's recomputation must save the same tensors as the forward
                scores = (torch.sigmoid(logits) if self.config.moe_router_score_function == "sigmoid"
                          else torch.softmax(logits, dim=-1))
            if self.training and torch._C._current_graph_task_id() == -1:  # not a recomputation in backward
                with torch.no_grad():
                    rows = routing_map if token_mask is None else routing_map[token_mask.reshape(-1).bool()]
                    self.expert_load.add_(rows.sum(0))
                if self.record_router_stats:
                    self.router_stats = RouterStats(scores, routing_map.sum(0), self.top_k)
            return out, bias

    return _Router, _MoELayer


class _RouteHook:
    """The top-k step of megatron-core's routing (`topk_routing_with_score_function(router_replay=...)`): its own
    choice, recorded for routing replay, or, with a `plan` (set through `_MoELayer.route_plan`), the recorded
    experts of each recorded token with megatron-core's scores of them (rows of -1: the token's own choice)."""

    def __init__(self) -> None:
        self.plan: Optional[tuple[RoutePlan, int]] = None

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: Optional[int], group_topk: Optional[int],
                        default_compute_topk):
        values, ids = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.plan is not None:
            plan, index = self.plan
            recorded = plan.layer(index, ids.shape[0], topk)
            plan.count(ids, recorded)
            if plan.force:
                ids = torch.where(recorded[:, :1] >= 0, recorded, ids)
                values = scores.gather(1, ids)  # = topk's values where the token keeps its own choice
        record_routes(ids, scores.shape[-1])
        return values, ids


@contextlib.contextmanager
def _alltoall_without_cuda():
    """megatron-core 0.16.1's all-to-all dispatcher creates a CUDA stream (for its device-to-host copies) when it is
    built; without CUDA a placeholder stands in while it is built (`alltoall_dispatcher` never uses it there)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as base

    placeholder = base.cuda_dtoh_stream is None and not torch.cuda.is_available()
    if placeholder:
        base.cuda_dtoh_stream = object()
    try:
        yield
    finally:
        if placeholder:
            base.cuda_dtoh_stream = None


@functools.cache
def alltoall_dispatcher():
    """megatron-core's all-to-all token dispatcher (parallel.ep > 1), also on the CPU: where the routing tensors
    are not on CUDA, its device-to-host stream synchronisation is skipped (there is nothing to copy), the token
    counts are all-gathered with `dist.all_gather` (its preprocess, dropless and tp = 1 only there) and its
    all-to-alls, whose outputs megatron-core 0.16.1 allocates on `torch.cuda.current_device()`, are our
    `parallel.expert_parallel._AllToAll` (the same `all_to_all_single`, output on the input's device; backward:
    the reverse exchange). On CUDA it is megatron-core's, unchanged."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from megatron_vlm.parallel.expert_parallel import _AllToAll

    def splits(s):
        return [int(v) for v in (s.tolist() if hasattr(s, "tolist") else s)]

    class _AllToAllDispatcher(MoEAlltoAllTokenDispatcher):
        def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
            """megatron-core's dropless preprocess (tp = 1) with the token counts all-gathered on their device."""
            if routing_map.is_cuda:
                return super().preprocess(routing_map)
            if (self.drop_and_pad or self.config.moe_expert_capacity_factor is not None or self.tp_size > 1
                    or self.config.moe_router_padding_for_quantization):
                raise _refuse("token dropping / padding or tensor parallelism with expert parallelism on the CPU",
                              "only megatron-core's dropless all-to-all with tp = 1 runs without CUDA")
            import torch.distributed as dist

            counts = routing_map.sum(dim=0).long()  # [E]: this rank's token copies per expert
            self.num_out_tokens = routing_map.size(0) * self.config.moe_router_topk
            self.input_splits = counts.reshape(self.ep_size, self.num_local_experts).sum(dim=1)
            gathered = [torch.empty_like(counts) for _ in range(self.ep_size)]
            dist.all_gather(gathered, counts, group=self.tp_ep_group)
            lo, hi = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
            per_local = torch.stack(gathered)[:, lo:hi].contiguous()  # [source ep rank, local expert]
            self.output_splits = per_local.sum(dim=1)
            self.output_splits_tp = per_local.sum().reshape(1)
            if self.num_local_experts > 1:
                self.num_global_tokens_per_local_expert = per_local
            return per_local.sum(dim=0)

        def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
            if self.routing_map.is_cuda:
                return super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)
            return tokens_per_expert

        def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
            if permutated_local_input_tokens.is_cuda:
                return super().token_dispatch(permutated_local_input_tokens, permuted_probs)
            out, inp = splits(self.output_splits), splits(self.input_splits)
            return (_AllToAll.apply(permutated_local_input_tokens, out, inp, self.ep_group),
                    _AllToAll.apply(permuted_probs, out, inp, self.ep_group))

        def token_combine(self, hidden_states, async_finish: bool = True, allocate_on_comm_stream: bool = True):
            if hidden_states.is_cuda:
                return super().token_combine(hidden_states, async_finish, allocate_on_comm_stream)
            return _AllToAll.apply(hidden_states, splits(self.input_splits), splits(self.output_splits), self.ep_group)

    return _AllToAllDispatcher


def moe_layer_spec(mlp_spec, *, expert_bias: bool, ep_group=None):
    """`mlp_spec` (a megatron-core MoE ModuleSpec from a layer spec) with our router / MoELayer subclasses;
    `ep_group`: our ep mesh's expert-parallel group (None: megatron-core's, ep = 1 or checked equal to ours)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    router, layer = mcore_moe_classes()
    sub = mlp_spec.submodules
    sub = type(sub)(experts=sub.experts, shared_experts=sub.shared_experts,
                    router=functools.partial(router, expert_bias=expert_bias))
    from megatron.core.process_groups_config import ProcessGroupCollection

    # megatron-core's TransformerLayer passes its process groups only to the MoELayer class itself: they are
    # given here (megatron-core's parallel state: tp = parallel.tp, expert tp = 1, ep = parallel.ep,
    # layer.ensure_parallel_state)
    pgs = replicated_over_tp(ProcessGroupCollection.use_mpu_process_groups(), ep_group)
    params = dict(mlp_spec.params or {}, pg_collection=pgs)
    return ModuleSpec(module=layer, params=params, submodules=sub)


def replicated_over_tp(pgs, ep_group=None):
    """megatron-core's process groups `pgs` with the tensor-parallel ones (`tp`, `tp_cp`) replaced by the expert
    tensor-parallel group, of size 1: the MoE layer built with them is whole on every tp rank and runs the whole
    sequence there, as the native backend's MoE blocks under tp (parallel/tensor_parallel.py, "replicated").
    Why not megatron-core's own tp MoE: its MoELayer refuses training with tp > 1 without sequence parallelism,
    which its local spec's torch RMSNorms refuse (and whose gathers allocate on CUDA); and the native reference
    replicates. The layer's parameters then get the same, complete gradient on every tp rank (counted once:
    `tp_shard.distribute_layer_params` makes them `Replicate` on the tp mesh).

    `ep_group` (expert parallelism with tp > 1): our ep mesh's group — `ep` ranks of one tp coordinate
    (parallel/mesh.py build_ep_mesh), which megatron-core's expert groups for expert tp = 1 (consecutive ranks)
    are not — becomes the layer's expert-parallel group and, expert tp being 1, its expert tp x ep group."""
    one = pgs.expt_tp
    if one is None or one.size() != 1:
        raise AssertionError("megatron-core's expert tensor-parallel group must be of size 1 (ensure_parallel_state)")
    pgs.tp = one
    pgs.tp_cp = one
    if ep_group is not None:
        pgs.ep = ep_group
        pgs.tp_ep = ep_group
    return pgs


def check_decoder_moe(moe: MoE) -> None:
    """The MoE block of a pre-norm `DecoderLayer` (Qwen3-MoE): its layer's TransformerConfig is the dense one
    (SwiGLU, no biases), so the experts must be SwiGLU and there is no shared expert."""
    kw = moe_config_kwargs(moe)
    if not kw["gated_linear_unit"] or kw["activation_func"] is not F.silu or moe.shared_experts is not None:
        raise _refuse("of a decoder layer with non-SwiGLU experts or shared experts",
                      "the layer's megatron-core config is the SwiGLU decoder's")


def moe_decoder_layer_spec(config, *, expert_bias: bool, ep_group=None):
    """megatron-core's local TransformerLayer spec with a MoE MLP (SequentialMLP experts) and our subclasses."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm,
                                    num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    spec.submodules.mlp = moe_layer_spec(spec.submodules.mlp, expert_bias=expert_bias, ep_group=ep_group)
    return spec


def moe_to_mcore(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Native `MoE` block state (keys relative to it) -> megatron-core MoELayer state (relative); exact."""
    state = dict(state)
    out = {"router.weight": state.pop("gate.weight")}
    if "gate.e_score_correction_bias" in state:
        out["router.expert_bias"] = state.pop("gate.e_score_correction_bias")
    first = state.pop("experts.gate_up_proj", None)
    first = state.pop("experts.up_proj") if first is None else first
    for j, (fc1, fc2) in enumerate(zip(first, state.pop("experts.down_proj"))):
        out[f"experts.local_experts.{j}.linear_fc1.weight"] = fc1
        out[f"experts.local_experts.{j}.linear_fc2.weight"] = fc2
    for ours, theirs in (("shared_experts.up_proj.weight", "shared_experts.linear_fc1.weight"),
                         ("shared_experts.down_proj.weight", "shared_experts.linear_fc2.weight")):
        if ours in state:
            out[theirs] = state.pop(ours)
    if state:
        raise KeyError(f"moe_to_mcore: no megatron-core counterpart for {sorted(state)}")
    return out


def mcore_to_moe(state: dict[str, torch.Tensor], *, gated: bool) -> dict[str, torch.Tensor]:
    """megatron-core MoELayer state (relative keys, `_extra_state` dropped) -> native `MoE` block state."""
    out: dict[str, torch.Tensor] = {}
    fc1: dict[int, torch.Tensor] = {}
    fc2: dict[int, torch.Tensor] = {}
    named = {"router.weight": "gate.weight", "router.expert_bias": "gate.e_score_correction_bias",
             "shared_experts.linear_fc1.weight": "shared_experts.up_proj.weight",
             "shared_experts.linear_fc2.weight": "shared_experts.down_proj.weight"}
    for key, value in state.items():
        if key.endswith("_extra_state"):
            continue
        if key in named:
            out[named[key]] = value
            continue
        parts = key.split(".")
        if len(parts) == 5 and parts[:2] == ["experts", "local_experts"] and parts[3] in ("linear_fc1", "linear_fc2") \
                and parts[4] == "weight":
            (fc1 if parts[3] == "linear_fc1" else fc2)[int(parts[2])] = value
        else:
            raise KeyError(f"mcore_to_moe: no native counterpart for {key!r}")
    for which, by_index in ((("experts.gate_up_proj" if gated else "experts.up_proj"), fc1), ("experts.down_proj", fc2)):
        if sorted(by_index) != list(range(len(by_index))):
            raise KeyError(f"mcore_to_moe: experts {sorted(by_index)} are not 0..{len(by_index) - 1}")
        out[which] = torch.stack([by_index[j] for j in range(len(by_index))])
    return out
