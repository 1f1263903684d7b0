"""`parallel.compile` with `train.activation_checkpointing` on blocks holding eager-only parts (the MoE layer's routed
experts, Mamba2's packed conv / scan: `compile_opaque`).

Dynamo traces a checkpoint as one region that cannot break its graph, so such a checkpointed block compiled whole
runs uncompiled. The compile units are found inside it instead, and these tests check what actually runs compiled
(the parameters each graph reads), that the losses and gradients are the eager model's, and that packs of new token
counts compile nothing new within dynamo's recompile limit.
"""
import copy

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters

from megatron_vlm.parallel import apply as ac_apply


def _recording_backend(model, base="aot_eager"):
    """A dynamo backend running each graph with `base` that records the names of the parameters of `model` the
    graphs read (parameters are graph inputs), so a test sees which modules run compiled."""
    names = {id(p): n for n, p in model.named_parameters()}
    seen: set[str] = set()

    def backend(gm, example_inputs):
        seen.update(names[id(t)] for t in example_inputs if id(t) in names)
        return lookup_backend(base)(gm, example_inputs)

    return backend, seen


def _nemotron_h(layers=("linear_attention", "moe", "full_attention", "mlp")):
    """Nemotron-3-Nano-VL's hybrid decoder (by default one Mamba2, MoE, attention and MLP block), tiny."""
    from transformers import NemotronHConfig

    from megatron_vlm.models import build_model

    cfg = dict(vocab_size=64, hidden_size=16, layers_block_type=list(layers),
               num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=16, mamba_num_heads=2,
               mamba_head_dim=8, ssm_state_size=4, n_groups=1, conv_kernel=4, chunk_size=4, n_routed_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=8, moe_shared_expert_intermediate_size=8, n_group=1,
               topk_group=1, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return build_model(dict(NemotronHConfig(**cfg).to_dict())).float().train()


def _packs(lens_list, seed, vocab=64):
    g = torch.Generator().manual_seed(seed)
    for lens in lens_list:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        yield torch.randint(1, vocab, (1, sum(lens)), generator=g), cu


def _same_step(compiled, eager, ids, cu):
    """One forward / backward of both models: equal losses and gradients (fp32)."""
    losses = []
    for model in (compiled, eager):
        model.zero_grad(set_to_none=True)
        loss = model(ids, cu_seqlens=cu).logsumexp(-1).mean()
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    for (name, pc), pe in zip(compiled.named_parameters(), eager.parameters()):
        assert (pc.grad is None) == (pe.grad is None), name
        if pe.grad is not None:
            torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-5, atol=1e-7, msg=name)


def _tiny_moe_lm():
    """Qwen3-MoE, tiny: layer 0 a MoE layer (top 2 of 4 experts), layer 1 dense."""
    from megatron_vlm.models import build_model
    from megatron_vlm.testing.tiny_text_model import tiny_qwen_text_hf_config

    torch.manual_seed(0)
    return build_model(tiny_qwen_text_hf_config("qwen3_moe")).float().train()


@pytest.mark.parametrize("policy", [None, "full", "selective"])
def test_compile_units_of_checkpointed_moe_layers(policy):
    """A checkpoint compiles whole or not at all and the routed experts are eager, so a checkpointed MoE layer
    compiled whole ran uncompiled, taking every block sharing apply_ac's wrapper with it. Its children are the
    units, the MoE layer whole: under selective checkpointing too, its checkpoint moved to the router (traced)
    and the routed experts (eager: dynamo never enters it), the layer compiled around them."""
    from megatron_vlm.models.common.moe import MoE

    model = _tiny_moe_lm()
    blocks = model.transformer_blocks()
    if policy:
        ac_apply.apply_ac(blocks, policy=policy)
    moe = [b for b in blocks if any(isinstance(m, MoE) for m in b.modules())]
    dense = [b for b in blocks if b not in moe]
    assert moe and dense  # the tiny model has both kinds of decoder layer
    units, eager = ac_apply.compile_units(blocks)
    assert eager == []
    if policy is None:
        assert units == blocks
        return
    assert [u for u in units if u in blocks] == dense
    pieces = {type(u).__name__ for u in units if u not in blocks}
    assert pieces == {"Attention", "RMSNorm", "MoE"}
    if policy == "selective":
        ac_apply.apply_compile(blocks, backend="eager")
        layer = moe[0]
        assert not hasattr(layer, "_mvlm_ac_forward") and not hasattr(layer.mlp, "_mvlm_ac")
        assert layer.self_attn._mvlm_ac == layer.mlp.gate._mvlm_ac == layer.mlp.experts._mvlm_ac == "selective"
        assert getattr(layer.mlp.experts.forward, "_torchdynamo_disable", False)
        assert not getattr(layer.mlp.gate.forward, "_torchdynamo_disable", False)


def _steps(compiled, eager, packs):
    """Training steps of both models on `packs`: equal losses and gradients; the graph count after each step."""
    graphs = []
    for ids, cu in packs:
        _same_step(compiled, eager, ids, cu)
        graphs.append(counters["stats"]["unique_graphs"])
    return graphs


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_checkpointed_moe_layers_compile_around_their_experts(policy):
    """Checkpointing + compile on Qwen3-MoE. The MoE layer's router runs compiled, its routed experts in no graph:
    whole-block, inside the block's eager checkpoint; selective, in a checkpoint of its own traced into the MoE
    layer's graph (it was eager), the attention and norms in checkpoints of their own. Losses and gradients are
    the eager model's over packs of changing token counts, and after the second step nothing compiles again."""
    torch._dynamo.reset()
    counters.clear()
    eager = _tiny_moe_lm()
    compiled = copy.deepcopy(eager)
    for model in (eager, compiled):
        ac_apply.apply_ac(model.transformer_blocks(), policy=policy)
    backend, seen = _recording_backend(compiled)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        ac_apply.apply_compile(compiled.transformer_blocks(), backend=backend)
        graphs = _steps(compiled, eager, _packs(([20, 28], [15, 22], [9, 30]), seed=2, vocab=1024))
    assert graphs[2] == graphs[1], f"graphs compiled after each step: {graphs}"
    moe, dense = "language_model.layers.0.", "language_model.layers.1."
    want = {moe + "input_layernorm.weight", moe + "self_attn.q_proj.weight", moe + "post_attention_layernorm.weight",
            dense + "self_attn.q_proj.weight", dense + "mlp.down_proj.weight", moe + "mlp.gate.weight"}
    assert want <= seen, sorted(want - seen)
    assert not {n for n in seen if n.startswith(moe + "mlp.experts.")}


@pytest.mark.heavy  # ~30 s of tracing on a shared 2-core machine
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_checkpointed_hybrid_blocks_compile_router_and_mamba_projections(policy):
    """Nemotron-H checkpointed. In the Mamba2 and MoE blocks the router, the shared expert and the Mamba2 mixer's
    projections and gated norm run in compiled graphs (the old units left the whole MoE layer and Mamba2 mixer
    eager, and under selective checkpointing the whole two blocks); the routed experts' and the Mamba2 conv's
    weights are read by no graph. Losses and gradients are the eager model's; packs of new token counts compile
    nothing new, and a new sample count stays within the recompile limit apply_compile sets."""
    torch._dynamo.reset()
    counters.clear()
    eager = _nemotron_h()
    compiled = copy.deepcopy(eager)
    for model in (eager, compiled):
        ac_apply.apply_ac(model.language_model.layers, policy=policy)
    backend, seen = _recording_backend(compiled)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        ac_apply.apply_compile(compiled.language_model.layers, backend=backend)
        graphs = _steps(compiled, eager, _packs(([6, 9], [4, 13], [5, 7], [3, 7, 5, 4]), seed=4))
    assert graphs[2] == graphs[1], f"graphs compiled after each step: {graphs}"
    mamba, moe = "language_model.layers.0.mixer.", "language_model.layers.1.mixer."
    assert {"language_model.layers.2.mixer.q_proj.weight", "language_model.layers.3.mixer.up_proj.weight"} <= seen
    want = {moe + "gate.weight", moe + "shared_experts.up_proj.weight", moe + "shared_experts.down_proj.weight",
            mamba + "in_proj.weight", mamba + "out_proj.weight", mamba + "norm.weight"}
    assert want <= seen, sorted(want - seen)
    assert not {n for n in seen if n.startswith(moe + "experts.")}
    if policy == "selective":  # the conv + scan in an eager checkpoint (under full a graph squeezes the weight)
        assert not {n for n in seen if n.startswith(mamba + "conv1d.")}


@pytest.mark.heavy  # inductor compiles C++ for the CPU: about a minute on a shared 2-core machine
@pytest.mark.parametrize("split", [True, False])
def test_selective_moe_layers_compile_with_inductor(split):
    """Inductor's code inside a selective checkpoint writes into buffers of matmul outputs the policy keeps, and
    torch refuses the mutated cache in backward: compiled units inside a MoE layer's block-wide selective
    checkpoint fail (`split` False: if this stops failing, a newer torch allows compiling inside it). With the
    checkpoint moved to the layer's children (`apply_compile`), the attention and norms compile with the policy
    traced into their graphs, and the gradients are the eager model's."""
    torch._dynamo.reset()
    counters.clear()
    eager = _tiny_moe_lm()
    compiled = copy.deepcopy(eager)
    for model in (eager, compiled):
        ac_apply.apply_ac(model.transformer_blocks(), policy="selective")
    if split:
        ac_apply.apply_compile(compiled.transformer_blocks())
    else:  # what the layer's children compiled inside its own checkpoint would do
        for unit in ac_apply._children_units(compiled.transformer_blocks()[0]):
            unit.compile()
    packs = _packs(([20, 28], [15, 22]), seed=2, vocab=1024)
    if not split:
        with pytest.raises(RuntimeError, match="selective activation checkpoint has been mutated"):
            _same_step(compiled, eager, *next(packs))
        return
    for ids, cu in packs:
        _same_step(compiled, eager, ids, cu)
    assert counters["inductor"]["fxgraph_cache_hit"] + counters["inductor"]["fxgraph_cache_miss"] >= 4


@pytest.mark.heavy  # inductor compiles C++ for the CPU: about a minute on a shared 2-core machine
def test_selective_hybrid_blocks_compile_with_inductor():
    """Nemotron-H's Mamba2 and MoE blocks under selective checkpointing, compiled with inductor: the projections,
    gated norm, router and shared expert in checkpoints traced into their mixers' graphs, the conv + scan and the
    routed experts in eager checkpoints that no compiled code runs inside (inductor's code there mutates the
    kept matmul outputs, which torch refuses in backward). Losses and gradients are the eager model's."""
    torch._dynamo.reset()
    counters.clear()
    eager = _nemotron_h(("linear_attention", "moe"))
    compiled = copy.deepcopy(eager)
    for model in (eager, compiled):
        ac_apply.apply_ac(model.language_model.layers, policy="selective")
    ac_apply.apply_compile(compiled.language_model.layers)
    for ids, cu in _packs(([6, 9], [4, 13]), seed=4):
        _same_step(compiled, eager, ids, cu)
    assert counters["inductor"]["fxgraph_cache_hit"] + counters["inductor"]["fxgraph_cache_miss"] >= 4


def test_selective_hybrid_blocks_trace_around_their_eager_pieces():
    """Nemotron-H's Mamba2 and MoE blocks under selective checkpointing + compile (dynamo's graphs run as traced,
    one pack: the fast form of the hybrid test above): the graphs read the Mamba2 projections and gated norm, the
    router and the shared expert, never the conv or the routed experts; losses and gradients are the eager
    model's."""
    torch._dynamo.reset()
    eager = _nemotron_h(("linear_attention", "moe"))
    compiled = copy.deepcopy(eager)
    for model in (eager, compiled):
        ac_apply.apply_ac(model.language_model.layers, policy="selective")
    backend, seen = _recording_backend(compiled, base="eager")
    ac_apply.apply_compile(compiled.language_model.layers, backend=backend)
    _same_step(compiled, eager, *next(_packs(([6, 9],), seed=4)))
    mamba, moe = "language_model.layers.0.mixer.", "language_model.layers.1.mixer."
    want = {mamba + "in_proj.weight", mamba + "norm.weight", mamba + "out_proj.weight", moe + "gate.weight",
            moe + "shared_experts.up_proj.weight", moe + "shared_experts.down_proj.weight"}
    assert want <= seen, sorted(want - seen)
    assert not {n for n in seen if n.startswith((mamba + "conv1d.", moe + "experts."))}
