"""Shared parallelisation helpers; a family's parallelize.py only lists its blocks and calls these.

Activation checkpointing wraps each block's forward in place (no wrapper module), so parameter
names — and therefore checkpoints and HF exports — are the same with and without it.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Optional

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.utils import _apply_to_tensors
from torch.utils.checkpoint import checkpoint

log = logging.getLogger("megatron_vlm")

SELECTIVE_SAVE_OPS = (
    "aten.mm", "aten.addmm", "aten._scaled_mm",
    # the routed experts' grouped GEMMs (kernels.grouped_mm = torch_grouped_mm, auto on Hopper) and batched ones
    "aten._grouped_mm", "aten.bmm",
    # torch SDPA's kernels (the CPU flash kernel has its own op)
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention",
    # every packed attention backend's forward op: ours (Triton, csrc), torch's flash varlen, flash-attn's
    "megatron_vlm.triton_attention_fwd", "megatron_vlm.varlen_attention_fwd", "torch_attn._varlen_attn",
    "flash_attn._flash_attn_varlen_forward", "flash_attn._flash_attn_forward",
)
"""Ops whose outputs selective checkpointing keeps: the matmuls and attention (the FLOPs); everything else
(norms, rotary, activations, casts: cheap, memory-bound) is recomputed in backward. An attention backend
whose op is missing here has its forward re-run in backward under "selective" (a step slower than its
kernel time says), so each backend's forward op is listed."""


def _selective_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    name = str(getattr(op, "_schema", None) and op._schema.name or op).replace("::", ".")
    keep = any(name == s or name.startswith(s + ".") for s in SELECTIVE_SAVE_OPS)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def ac_policy(activation_checkpointing) -> Optional[str]:
    """`train.activation_checkpointing` as a policy: None (off), "full" (true or "full") or "selective"."""
    if activation_checkpointing is False or activation_checkpointing is None:
        return None
    if activation_checkpointing is True:
        return "full"
    if activation_checkpointing in ("full", "selective"):
        return activation_checkpointing
    raise ValueError(f"activation checkpointing {activation_checkpointing!r}: expected true, false, 'full' or 'selective'")


def checkpoint_blocks(blocks: list[nn.Module], activation_checkpointing) -> Optional[str]:
    """Apply `train.activation_checkpointing` (false, true / "full", "selective") to `blocks`; its policy."""
    policy = ac_policy(activation_checkpointing)
    if policy is not None:
        apply_ac(blocks, policy=policy)
        log.info("activation checkpointing %s: %d transformer blocks", policy, len(blocks))
    return policy


def apply_ac(blocks: Iterable[nn.Module], policy: str = "full", *, eager: bool = False) -> None:
    """Checkpoint each block: `policy` "full" recomputes the whole block in backward; "selective" keeps the
    outputs of its matmuls and attention (SELECTIVE_SAVE_OPS) and recomputes only the cheap ops between them,
    trading memory for most of the recomputed FLOPs. `eager`: the checkpoint runs uncompiled even when called
    from compiled code (a selective checkpoint holding a compile-opaque part: `_checkpoint_pieces`)."""
    if policy not in ("full", "selective"):
        raise ValueError(f"activation checkpointing policy {policy!r}: expected 'full' or 'selective'")
    for block in blocks:
        if getattr(block, "_mvlm_ac", False):
            continue
        orig = block.forward
        block.forward = _checkpointed(orig, policy, eager=eager)
        block._mvlm_ac = policy  # read by apply_compile
        block._mvlm_ac_forward = orig  # the forward the checkpoint runs, for _checkpoint_children


def _checkpointed(fn, policy: str, *, eager: bool = False):
    """`fn` run in a checkpoint of `policy`; `eager`: never traced by dynamo (a graph break around it, nothing
    inside compiled), for a selective checkpoint around code dynamo cannot trace whole."""
    extra = {}
    if policy == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        extra = {"context_fn": functools.partial(create_selective_checkpoint_contexts, _selective_policy)}

    @functools.wraps(fn)
    def forward(*args, _orig=fn, _extra=extra, **kwargs):
        return checkpoint(_orig, *args, use_reentrant=False, **_extra, **kwargs)

    return torch.compiler.disable(forward) if eager else forward


def _checkpoint_children(block: nn.Module) -> None:
    """Move a block's selective checkpoint to its children (`_children_units`): each child its own checkpoint
    with the same policy, except an opaque child that declares pieces (`_pieces`), whose pieces get the
    checkpoints instead (`_checkpoint_pieces`); the block's forward runs unchecked between them."""
    orig = block.__dict__.pop("_mvlm_ac_forward", None)
    if orig is None:  # moved already
        return
    if getattr(orig, "__func__", None) is type(block).forward and getattr(orig, "__self__", None) is block:
        del block.forward  # the class's forward again
    else:
        block.forward = orig
    for child in _children_units(block):
        if _opaque(child) and _pieces(child):
            _checkpoint_pieces(child, block._mvlm_ac)
        else:
            apply_ac([child], policy=block._mvlm_ac)


def _pieces(module: nn.Module) -> dict[str, bool]:
    """The pieces a compile-opaque module declares (`selective_pieces`: attribute name -> runs compiled) that
    `module` holds: submodules or methods its forward calls, between which it does nothing worth recomputing.
    Under "selective" + `parallel.compile` each piece is its own selective checkpoint and the module is compiled
    around them (the MoE layer's router, shared experts and latent projections; the Mamba2 mixer's input and
    output projections), the eager pieces (the routed experts, the Mamba2 conv + scan) in checkpoints dynamo
    never enters."""
    return {name: compiled for name, compiled in getattr(module, "selective_pieces", {}).items()
            if getattr(module, name, None) is not None}


def _checkpoint_pieces(module: nn.Module, policy: str) -> None:
    """A checkpoint of `policy` around each of `module`'s pieces (`_pieces`): a submodule's forward or a method
    (an attribute of the instance), the eager ones never traced."""
    for name, compiled in _pieces(module).items():
        piece = getattr(module, name)
        if isinstance(piece, nn.Module):
            apply_ac([piece], policy=policy, eager=not compiled)
        else:
            setattr(module, name, _checkpointed(piece, policy, eager=not compiled))
    module._mvlm_ac_pieces = policy


RECOMPILE_LIMIT_PER_KIND = 8
"""Graphs dynamo may keep for one kind of block (its default limit per code object)."""


def _traced_code(block: nn.Module) -> object:
    """The code object dynamo keeps a block's graphs under: its forward's. A block checkpointed by `apply_ac` runs
    the one wrapper function of this module, whatever its class, so every checkpointed block shares one limit."""
    forward = block.forward
    return getattr(getattr(forward, "__func__", forward), "__code__", type(block))


def _opaque(module: nn.Module) -> bool:
    """Whether `module` holds a part that runs eagerly under torch.compile (`compile_opaque`: the MoE routed
    experts, Mamba2's packed conv / scan): dynamo breaks a plain block's graph around it, but a checkpointed
    block compiles whole or not at all."""
    return any(getattr(m, "compile_opaque", False) for m in module.modules())


def _children_units(module: nn.Module) -> list[nn.Module]:
    """The children of `module` that its forward calls, each to be compiled whole: the members of a container
    child (ModuleList / ModuleDict: no forward of its own) in its place."""
    units: list[nn.Module] = []
    for child in module.children():
        units += _children_units(child) if type(child).forward is nn.Module.forward else [child]
    return units


def _splits(block: nn.Module) -> bool:
    """Whether a selectively checkpointed block with a compile-opaque part is checkpointed per child under
    `parallel.compile`: when that compiles a matmul, in a child without opaque parts (attention, a dense MLP) or
    in the pieces of an opaque one (`_pieces`: the MoE router and shared experts, the Mamba2 projections).
    Splitting keeps the inputs of the children's and pieces' checkpoints that a block-wide checkpoint recomputes
    (the norms' outputs, the routing weights, the Mamba2 scan's output), counted by `--check`
    (plan/memory.py `split_extra_per_token`)."""
    children = _children_units(block)
    return (any(p.dim() >= 2 for c in children if not _opaque(c) for p in c.parameters())
            or any(_pieces(c) for c in children if _opaque(c)))


def compile_units(blocks: Iterable[nn.Module]) -> tuple[list[nn.Module], list[nn.Module]]:
    """(modules to compile, blocks left uncompiled) for `parallel.compile`.

    A block is compiled whole, except one checkpointed by `apply_ac` that holds a compile-opaque part (a MoE or
    Mamba2 decoder layer): dynamo cannot break the graph of a checkpoint, so it would run the whole block, and
    then every block sharing apply_ac's wrapper, uncompiled. Under whole-block checkpointing the block's
    children are compiled one by one inside the eager checkpoint, the opaque ones (the MoE layer, the Mamba2
    mixer) whole too: outside a traced checkpoint dynamo breaks their graphs around the eager part only, so the
    router, the shared experts, the latent and Mamba2 projections and the gated norm run compiled.

    Under "selective" no compiled code may run inside the block's eager checkpoint: inductor's code writes into
    buffers of the matmul outputs the policy keeps, and torch refuses the mutated cache. Such a block is
    checkpointed per child instead (`_splits`; `apply_compile` moves the checkpoint): its children without
    opaque parts are compiled, each with the policy traced into its graph; an opaque child that declares pieces
    (`_pieces`: the MoE layer, the Mamba2 mixer) is compiled whole around its pieces' checkpoints, traced ones
    for the router, shared experts and projections, eager ones for the routed experts and the Mamba2 conv +
    scan, so the same parts run compiled as under whole-block checkpointing; any other opaque child runs eagerly
    in a selective checkpoint of its own. A block that does not split stays eager."""
    units: list[nn.Module] = []
    eager: list[nn.Module] = []
    for block in blocks:
        policy = getattr(block, "_mvlm_ac", None)
        if not policy or not _opaque(block):
            units.append(block)
        elif policy == "full":
            units += _children_units(block)
        elif _splits(block):
            units += [c for c in _children_units(block) if not _opaque(c) or _pieces(c)]
        else:
            eager.append(block)
    return units, eager


def split_selective_checkpoints(blocks: Iterable[nn.Module]) -> None:
    """Move the selective checkpoint of each block that `_splits` to its children and pieces
    (`_checkpoint_children`), as `apply_compile` does before compiling them."""
    for block in blocks:
        if getattr(block, "_mvlm_ac", None) == "selective" and _opaque(block) and _splits(block):
            _checkpoint_children(block)


def apply_compile(blocks: Iterable[nn.Module], **compile_options) -> None:
    """torch.compile each block (`parallel.compile`; `compile_options` go to `nn.Module.compile`, e.g. a test's
    backend), raising dynamo's recompile limit to what the blocks need.

    Why the limit: dynamo keeps its graphs per code object, so all blocks of one class share one limit (8 by
    default), and a class whose blocks hold different submodules is traced once per kind (Nemotron-H's hybrid
    block: Mamba2 / MoE / attention / MLP mixers; a MoE decoder layer beside a dense one), each kind static
    first, then with dynamic lengths, and with a view or a plain tensor as input. Past the limit dynamo runs
    the block eagerly with only a log warning: a "compiled" run that is not. Blocks checkpointed by `apply_ac`
    all run one wrapper function, so their graphs, vision blocks and decoder layers alike, share one limit. The
    limit is raised (never lowered) to RECOMPILE_LIMIT_PER_KIND per kind of block of the code object that holds
    the most kinds."""
    blocks = list(blocks)
    split_selective_checkpoints(blocks)
    blocks, eager = compile_units(blocks)
    if eager:
        log.warning("parallel.compile: %d checkpointed blocks with eager-only parts and nothing to compile around "
                    "them in checkpoints of their own run uncompiled under train.activation_checkpointing = "
                    "\"selective\" (their matmul outputs cannot be kept from compiled code); with true all but "
                    "those parts are compiled", len(eager))
    kinds: dict[object, set] = {}
    for block in blocks:
        kinds.setdefault(_traced_code(block), set()).add(tuple(type(m) for m in block.modules()))
    need = RECOMPILE_LIMIT_PER_KIND * max((len(k) for k in kinds.values()), default=1)
    if torch._dynamo.config.recompile_limit < need:
        torch._dynamo.config.recompile_limit = need
    for block in blocks:
        block.compile(**compile_options)


def apply_fsdp(
    model: nn.Module,
    mesh,
    blocks: Iterable[nn.Module],
    *,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = torch.float32,
    reshard_after_forward: bool = True,
    ignored_params: Optional[set] = None,
) -> nn.Module:
    """FSDP2 (`fully_shard`) per block, then the root. A 2-D mesh gives HSDP (replicate x shard).
    `ignored_params` (expert-parallel weights, sharded on their own mesh) are left out of every unit:
    FSDP neither gathers, casts nor reduces them."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if mesh.ndim == 1:
        dp_mesh = mesh
    elif "cp" in (mesh.mesh_dim_names or ()) and mesh["cp"].size() > 1:  # FSDP over dp_shard x cp (context_parallel.py)
        dp_mesh = mesh[("dp_replicate", "dp_shard_cp")]
    else:
        dp_mesh = mesh[("dp_replicate", "dp_shard")]
    kwargs = {"ignored_params": set(ignored_params)} if ignored_params else {}
    # Modules whose weights stay fp32 (`fp32_weight`: Nemotron-H's routers) are units of their own gathered in
    # fp32, before the blocks holding them: in the block's unit they would be cast to `param_dtype` (bf16
    # routing is not the checkpoint's), and a unit needs one original dtype when nothing casts. An fp32 model
    # without a cast needs no extra units (fewer collectives, nothing changes).
    keep_fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for module in fp32_units(model, param_dtype):
        fully_shard(module, mesh=dp_mesh, mp_policy=keep_fp32, reshard_after_forward=reshard_after_forward, **kwargs)
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, **kwargs)
    return model


def fp32_units(model: nn.Module, param_dtype: Optional[torch.dtype]) -> list[nn.Module]:
    """The `fp32_weight` modules (Nemotron-H's routers) that `apply_fsdp` makes FSDP2 units of their own, inside
    their blocks: where the blocks' parameters are cast to `param_dtype` or are not all fp32 (`model.dtype`)."""
    casts = param_dtype is not None and param_dtype != torch.float32
    mixed = casts or any(p.dtype != torch.float32 for p in model.parameters())
    return [m for m in model.modules() if mixed and getattr(m, "fp32_weight", False)]


def _cast_inputs(dtype: torch.dtype):
    """A forward pre-hook casting the floating-point tensors among a module's inputs to `dtype` (FSDP2's
    `cast_forward_inputs`)."""
    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x

    def hook(module, args, kwargs):
        return _apply_to_tensors(cast, args), _apply_to_tensors(cast, kwargs)
    return hook


def apply_input_casts(model: nn.Module, blocks: Iterable[nn.Module], param_dtype: torch.dtype) -> None:
    """Without FSDP2 units (`parallel.fsdp = false`, parallel/master_weights.py), the input casts FSDP2's mixed
    precision makes, at the same modules: the root and each block cast their floating-point inputs to `param_dtype`
    (the pixels, the rotary tables made in fp32), `fp32_weight` modules to fp32, so the step computes what an
    FSDP2 run on one rank computes."""
    for module in model.modules():
        if getattr(module, "fp32_weight", False):
            module.register_forward_pre_hook(_cast_inputs(torch.float32), with_kwargs=True)
    for block in blocks:
        block.register_forward_pre_hook(_cast_inputs(param_dtype), with_kwargs=True)
    model.register_forward_pre_hook(_cast_inputs(param_dtype), with_kwargs=True)


def parallelize_blocks(
    model: nn.Module,
    blocks: list[nn.Module],
    parallel_cfg,
    *,
    mesh=None,
    activation_checkpointing: bool | str = False,
    param_dtype: Optional[torch.dtype] = None,
    root: Optional[nn.Module] = None,
    fsdp_blocks: Optional[list[nn.Module]] = None,
    ignored_params: Optional[set] = None,
) -> nn.Module:
    """The tail every family shares: activation checkpointing -> compile -> FSDP2.

    `activation_checkpointing`: train.activation_checkpointing (false, true / "full", "selective"; `ac_policy`).
    `blocks` get activation checkpointing / compile; `fsdp_blocks` (default `blocks`) become their
    own FSDP units. Families pass only the decoder layers as `fsdp_blocks`: a vision block that is
    its own unit all-gathers in its forward, so a rank whose micro-batch has no image would skip
    that collective and hang the others; vision parameters in the root unit are gathered with the
    root on every rank instead. `root` is the module that becomes the root FSDP unit (default
    `model`; the trainer passes its log-prob wrapper so the output projection runs inside the root's
    forward). `mesh` None skips FSDP (with a `param_dtype`: `apply_input_casts`). `ignored_params` are kept out of FSDP (expert-parallel weights).
    """
    policy = checkpoint_blocks(blocks, activation_checkpointing)
    units = {id(m) for m in fp32_units(root if root is not None else model, param_dtype)}
    if policy == "selective" and mesh is not None and any(id(m) in units for b in blocks for m in b.modules()):
        # a nested FSDP2 unit's hooks (gather, casts, profiler ranges) may dispatch other operators when the
        # checkpoint recomputes the block than in its forward (one rank, torch 2.13), which a selective checkpoint's
        # per-operator replay refuses at the first backward: checkpointed per child and piece instead, as under
        # parallel.compile (every layout: what the hooks dispatch is not the model's to promise), so that the
        # router's hooks run outside every checkpoint (its own piece checkpoints its forward, not its hooks); an fp32
        # unit outside the blocks (a reward model's head) needs none of this
        split_selective_checkpoints(blocks)
    if getattr(parallel_cfg, "compile", False):
        apply_compile(blocks)
    if mesh is not None:
        apply_fsdp(root if root is not None else model, mesh, blocks if fsdp_blocks is None else fsdp_blocks,
                   param_dtype=param_dtype,
                   reshard_after_forward=getattr(parallel_cfg, "reshard_after_forward", True),
                   ignored_params=ignored_params)
    elif param_dtype is not None and param_dtype != torch.float32:  # bf16 weights, fp32 masters beside them
        apply_input_casts(root if root is not None else model, blocks if fsdp_blocks is None else fsdp_blocks,
                          param_dtype)
    return model
