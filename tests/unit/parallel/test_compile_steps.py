"""`parallel.compile` on blocks with host-sized parts over training steps whose packs change (packed SFT / RL).

MoE: the routed experts size their grouped GEMMs from per-expert counts read on the host; Mamba2: the packed
conv / scan references loop over the samples read from cu_seqlens on the host. Traced, such a read breaks the
graph and the values read become constants of the code after it, so every step (new counts, new sample
lengths) compiled again until dynamo's recompile limit sent the block back to eager. Those parts run eagerly
inside the compiled block instead: after the first change of shape (dynamo then marks the token dim dynamic)
no step compiles anything, and outputs and gradients are those of the eager block.
"""
import copy

import pytest
import torch
from torch._dynamo.utils import counters

from megatron_vlm.models.common.mamba2 import Mamba2Mixer
from megatron_vlm.models.common.mlp import SwiGLUMLP
from megatron_vlm.models.common.moe import MoE


def _moe_block():
    """Qwen3-MoE's block shape (softmax router, top 2 of 4 experts) with a shared expert, tiny."""
    torch.manual_seed(0)
    block = MoE(32, num_experts=4, top_k=2, moe_intermediate_size=16, activation="silu", gated_experts=True,
                shared_experts=SwiGLUMLP(32, 24))
    block.reset_parameters(0.2)
    return block.train()


def _same_step(compiled, eager, x, **kw):
    """Forward and backward of both modules on copies of `x`: equal outputs and input gradients."""
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    yc, ye = compiled(xc, **kw), eager(xe, **kw)
    torch.testing.assert_close(yc, ye, rtol=1e-6, atol=1e-6)
    yc.square().sum().backward()
    ye.square().sum().backward()
    torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-6, atol=1e-6)


def test_compiled_moe_block_compiles_once_for_changing_token_counts():
    torch._dynamo.reset()
    counters.clear()
    eager = _moe_block()
    compiled = copy.deepcopy(eager)
    compiled.compile(backend="eager")  # dynamo alone: graphs, breaks and guards are its own
    g = torch.Generator().manual_seed(1)
    graphs = []
    for tokens in (11, 17, 6):
        x = torch.randn(tokens, 32, generator=g)
        _same_step(compiled, eager, x)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[1], f"graphs compiled after each step: {graphs}"
    for (name, pc), pe in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-6, atol=1e-6, msg=name)
    assert torch.equal(compiled.expert_load, eager.expert_load) and int(eager.expert_load.sum()) == 2 * 34
    # the only break is the eager expert region (torch.compiler.disable), not a host read inside traced code
    assert all("disable" in reason for reason in counters["graph_break"]), dict(counters["graph_break"])


@pytest.mark.heavy  # ~5 s of tracing on a shared 2-core machine
def test_compiled_mamba2_mixer_compiles_once_for_changing_packs():
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = Mamba2Mixer(32, num_heads=4, head_dim=8, state_size=8, n_groups=2, chunk_size=4).train()
    compiled = copy.deepcopy(eager)
    compiled.compile(backend="eager")  # dynamo alone: graphs, breaks and guards are its own
    g = torch.Generator().manual_seed(2)
    graphs = []
    for lens in ([5, 9, 3], [7, 4], [2, 8, 6, 3], [11, 5]):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        x = torch.randn(1, sum(lens), 32, generator=g)
        _same_step(compiled, eager, x, cu_seqlens=cu)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[1], f"graphs compiled after each step: {graphs}"
    assert all("disable" in reason for reason in counters["graph_break"]), dict(counters["graph_break"])


# the backends a CUDA device takes for a dense decoder layer (kernels/builtin_ops.py), interpreted here
GPU_DENSE_OPS = {"attention": "triton", "rms_norm": "triton", "apply_rotary": "triton", "swiglu": "triton"}


@pytest.mark.heavy  # the Triton kernels run in their interpreter on the CPU (minutes on a shared machine)
def test_compiled_decoder_layers_on_the_gpu_backends_never_break_and_stop_compiling():
    """The GPU path of parallel.compile for a dense family (Qwen2 layout: GQA attention, RMSNorm, rotary,
    SwiGLU on the Triton custom ops): packs whose token count, sample count and longest sample all change.
    No graph break inside a layer (each layer one graph, forward and backward through the ops' registered
    fake kernels and autograd); after the first change of shapes no step compiles anything (the lengths and
    cu_seqlens are dynamic, max_seqlen a symbolic int, none read on the host); loss and gradients equal eager."""
    from megatron_vlm import kernels
    from megatron_vlm.models import build_model
    from megatron_vlm.testing.tiny_text_model import tiny_qwen_text_hf_config

    torch._dynamo.reset()
    counters.clear()
    with kernels.use_backends(GPU_DENSE_OPS):
        torch.manual_seed(0)
        eager = build_model(tiny_qwen_text_hf_config("qwen2", hidden=32, layers=2, vocab_size=64), dtype=torch.float32,
                            device="cpu").train()
        compiled = copy.deepcopy(eager)
        for block in compiled.transformer_blocks():
            block.compile(backend="aot_eager")
        graphs = []
        g = torch.Generator().manual_seed(3)
        for lens in ([6, 9], [4, 11, 3], [8, 2, 5, 7]):
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
            ids = torch.randint(1, 64, (1, sum(lens)), generator=g)
            pos = torch.cat([torch.arange(n) for n in lens])[None]
            losses = []
            for model in (compiled, eager):
                model.zero_grad(set_to_none=True)
                loss = model(ids, cu_seqlens=cu, position_ids=pos).logsumexp(-1).mean()
                loss.backward()
                losses.append(loss.detach())
            torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
            for (name, pc), pe in zip(compiled.named_parameters(), eager.parameters()):
                torch.testing.assert_close(pc.grad, pe.grad, rtol=0, atol=0, msg=name)
            graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs[-1] == graphs[1], f"graphs compiled after each step: {graphs}"


def _nemotron_h():
    from transformers import NemotronHConfig

    from megatron_vlm.models import build_model

    cfg = dict(vocab_size=64, hidden_size=16, layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
               num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=16, mamba_num_heads=2,
               mamba_head_dim=8, ssm_state_size=4, n_groups=1, conv_kernel=4, chunk_size=4, n_routed_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=8, moe_shared_expert_intermediate_size=8, n_group=1,
               topk_group=1, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return build_model(dict(NemotronHConfig(**cfg).to_dict())).float().train()


@pytest.mark.heavy  # ~10 s of tracing
def test_hybrid_blocks_fit_the_recompile_limit():
    """Nemotron-H's blocks share one forward but hold four kinds of mixer, each traced on its own (static, then
    dynamic lengths): 8 graphs by the second step, dynamo's default limit for one code object; one more (here
    the number of samples changing later) and the block would silently run eagerly. apply_compile raises the
    limit per kind of block; with dynamo set to fail at the limit, steps of changing packs run compiled."""
    from megatron_vlm.parallel import apply_compile

    torch._dynamo.reset()
    model = _nemotron_h()
    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True):
        apply_compile(model.language_model.layers, backend="eager")
        assert torch._dynamo.config.recompile_limit == 4 * 8
        g = torch.Generator().manual_seed(4)
        for lens in ([6, 9], [4, 11], [8, 2, 5], [3, 7, 5, 4]):
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
            model(torch.randint(1, 64, (1, sum(lens)), generator=g), cu_seqlens=cu).logsumexp(-1).mean().backward()


@pytest.mark.parametrize("moe,policy", [(False, None), (False, "selective"), (True, "full"), (True, "selective")])
def test_checkpointed_blocks_of_every_class_share_one_recompile_limit(monkeypatch, moe, policy):
    """Checkpointed blocks (train.activation_checkpointing true or "selective") all run apply_ac's one wrapper
    function, the code object dynamo keeps their graphs under: the vision blocks' and the decoder layers' graphs
    count against one limit, which must hold every kind of block of every class. Counted per class, the limit of
    an SFT job with parallel.compile was hit within its first steps and the blocks ran eagerly, with only a log
    line. Here dynamo fails at the limit, RECOMPILE_LIMIT_PER_KIND is what uncheckpointed blocks need for these
    packs, and the checkpointed ones must run within it too. Qwen3-VL-MoE: its checkpointed MoE layers' units
    (their children, compiled one by one, under "selective" in checkpoints of their own) as well."""
    from megatron_vlm.models import build_model
    from megatron_vlm.parallel import apply as ac_apply
    from megatron_vlm.testing import tiny_processor_qwen3_vl as Q3

    monkeypatch.setattr(ac_apply, "RECOMPILE_LIMIT_PER_KIND", 3)
    torch.manual_seed(0)
    model = build_model(Q3.tiny_qwen3_vl_config_dict(moe=moe)).float().train()
    g = torch.Generator().manual_seed(1)
    packs = [Q3.pack_samples([Q3.build_sample(parts, g)])
             for parts in ([3, ("image", (1, 4, 8)), 5], [2, ("image", (1, 8, 8)), 4], [6, ("image", (1, 4, 4)), 3],
                           [5, ("image", (1, 8, 4)), 9])]
    packs = [{k: v for k, v in p.items() if v is not None} for p in packs]
    model(**packs[0])  # eager once: the kernels' lazy loading is not traced as state of the first graph
    torch._dynamo.reset()
    blocks = model.transformer_blocks()
    if policy:
        ac_apply.apply_ac(blocks, policy=policy)
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        ac_apply.apply_compile(blocks, backend="eager")
        for batch in packs:
            model(**batch).logsumexp(-1).mean().backward()


def test_rollouts_through_compiled_blocks_decode_eagerly():
    """GRPO's shared-weights engine and evaluation decode with the trainer's model, whose blocks parallel.compile
    compiled for training. Traced, each layer index and cache length was a graph of its own and the first decode
    call hit dynamo's recompile limit (fails here); decoding now runs eagerly: nothing compiled, same tokens."""
    from megatron_vlm.inference.engine import SamplingParams
    from megatron_vlm.parallel import apply as ac_apply
    from tests.fixtures.rollout_engine import SilentTokenizer, make_engine, tiny_vl_model_and_prompts

    model, prompts = tiny_vl_model_and_prompts(3)
    greedy = SamplingParams(max_new_tokens=6, n=1, temperature=0.0)
    want = [s.token_ids.tolist() for s in make_engine(model, SilentTokenizer(), eos_token_ids=[-1]).generate(prompts, greedy).samples]
    counters.clear()
    torch._dynamo.reset()
    ac_apply.apply_compile(model.transformer_blocks(), backend="aot_eager")
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for forward in (None, lambda **kw: model(**kw)):  # the engine's own model; the trainer's forward
            engine = make_engine(model, SilentTokenizer(), eos_token_ids=[-1], forward=forward)
            assert [s.token_ids.tolist() for s in engine.generate(prompts, greedy).samples] == want
    assert counters["stats"]["unique_graphs"] == 0
