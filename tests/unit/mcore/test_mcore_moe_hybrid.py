"""`parallel.backend = "mcore"` for MoE decoders (Qwen3-MoE, Qwen3-VL-MoE: megatron-core's MoELayer) and the
Nemotron-H hybrid (Nemotron-VL: MambaLayer with our Mamba2 mixer, attention / MLP / MoE layers), against the
native model: log-probs and gradients of a packed batch with shared prompts, greedy rollouts through the
engine's caches, the exported state dict, the routing variants megatron-core expresses (sigmoid with the
expert bias, groups, routed scaling, shared expert), the `[moe]` balancer's statistics, and the refusals."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("megatron.core")  # installed by the dev extra

from megatron_vlm.checkpoint.hf import load_hf_model  # noqa: E402
from megatron_vlm.data.processor import load_processor  # noqa: E402
from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa  # noqa: E402
from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams  # noqa: E402
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine  # noqa: E402
from megatron_vlm.models.common.moe import moe_layers  # noqa: E402
from megatron_vlm.models.mcore.hybrid import McoreHybridBlock  # noqa: E402
from megatron_vlm.models.mcore.layer import McoreBackendError, native_state_dict, use_mcore_layers  # noqa: E402
from megatron_vlm.models.nemotron_vl.args import NemotronHTextArgs  # noqa: E402
from megatron_vlm.models.nemotron_vl.model import NemotronHTextModel  # noqa: E402
from megatron_vlm.rl.batching import TrainSample, pack_samples  # noqa: E402
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset  # noqa: E402
from megatron_vlm.rl.prompts.encoder import PromptEncoder  # noqa: E402
from megatron_vlm.testing.synthesize import synthesize_model_folder  # noqa: E402
from megatron_vlm.training.lm_loss import TokenLogprobModel  # noqa: E402
from megatron_vlm.training.moe_balancing import MoEConfig, MoELoadBalancer  # noqa: E402


def _grads(model):
    grads = {}
    decoder = getattr(model, "language_model", model)
    for i, layer in enumerate(decoder.layers):  # per native name, mcore layers mapped back
        own = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
        if hasattr(layer, "native_state"):
            own = layer.native_state({n.removeprefix("mcore."): g for n, g in own.items()})
        grads.update({f"layer{i}.{n}": g for n, g in own.items()})
    rest = {n: p.grad for n, p in model.named_parameters()
            if p.grad is not None and ".layers." not in n and not n.startswith("layers.")}
    return {**grads, **rest}


def _logp_grads(model, batch, weights):
    model.zero_grad(set_to_none=True)
    logp = TokenLogprobModel(model).train()({k: v for k, v in batch.items() if k != "num_response_tokens"})
    (logp * weights).sum().backward()
    return logp.detach(), _grads(model)


def _with_expert_bias(model, seed):
    """A non-zero score-correction bias, so the expert choice differs from the combine weights' order."""
    g = torch.Generator().manual_seed(seed)
    for moe in moe_layers(model):
        if moe.gate.e_score_correction_bias is not None:
            moe.gate.e_score_correction_bias.copy_(torch.randn(moe.num_experts, generator=g) * 0.3)


@pytest.mark.parametrize("kind", ["tiny_qwen3_moe", "tiny_qwen3_vl_moe", "tiny_nemotron_vl"])
def test_mcore_moe_and_hybrid_decoders_equal_the_native(kind, mcore_state, tmp_path):
    folder = synthesize_model_folder(kind, tmp_path / kind, seed=0)
    native = load_hf_model(str(folder), dtype=torch.float32)
    _with_expert_bias(native, 3)
    if kind == "tiny_qwen3_moe":  # text Qwen3-MoE without renormalised top-k weights (megatron-core's pre-softmax)
        for moe in moe_layers(native):
            moe.gate.norm_topk_prob = False
    mc = copy.deepcopy(native)
    use_mcore_layers(mc)
    vocab = native.lm_head.weight.shape[0]
    if kind.startswith("tiny_nemotron"):
        kinds = {type(layer.mcore).__name__ for layer in mc.language_model.layers}
        assert kinds == {"MambaLayer", "TransformerLayer", "MLPLayer"}
        assert all(isinstance(layer, McoreHybridBlock) for layer in mc.language_model.layers)
    pre_softmax = [m.config.moe_router_pre_softmax for m in moe_layers(mc)]
    assert all(pre_softmax) if kind == "tiny_qwen3_moe" else not any(pre_softmax)
    mc_moes = moe_layers(mc)
    assert len(mc_moes) == len(moe_layers(native)) > 0
    assert all(type(m).__mro__[1].__name__ == "MoELayer" for m in mc_moes)

    back = native_state_dict(mc.state_dict(), mc)  # export: native names and tensors, bit-exactly
    ref = native.state_dict()
    assert back.keys() == ref.keys() and all(torch.equal(back[k], ref[k]) for k in ref)

    proc = load_processor(str(folder))
    if kind == "tiny_qwen3_moe":
        g = torch.Generator().manual_seed(1)
        prompts = [RolloutPrompt(torch.randint(0, vocab, (n,), generator=g)) for n in (7, 12, 4)]
    else:
        vqa = write_synthetic_vqa(tmp_path / "vqa", 2, 3, seed=0)["eval"]
        encoder = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=5, max_tokens=4096)
        prompts = [encoder.encode(s) for s in load_prompt_dataset(vqa, schema="messages").samples]
    g = torch.Generator().manual_seed(2)
    samples = [TrainSample(p, torch.randint(0, vocab, (int(n),), generator=g), torch.zeros(int(n)), 0.0)
               for p in prompts for n in torch.randint(1, 6, (2,), generator=g)]
    batch = pack_samples(samples, share_prompts=not kind.startswith("tiny_nemotron"))  # Nemotron-VL: no shared-prompt packs
    weights = torch.randn(batch["num_response_tokens"], generator=g)
    lp_n, g_n = _logp_grads(native, batch, weights)
    lp_m, g_m = _logp_grads(mc, batch, weights)
    torch.testing.assert_close(lp_m, lp_n, atol=1e-5, rtol=0)
    assert g_m.keys() == g_n.keys()
    for name in g_n:
        torch.testing.assert_close(g_m[name], g_n[name], atol=1e-5, rtol=1e-4, msg=name)
    # the training forward counted the same expert loads (the balancer's input)
    for a, b in zip(moe_layers(mc), moe_layers(native)):
        assert torch.equal(a.expert_load, b.expert_load) and a.expert_load.sum() > 0

    params = SamplingParams(max_new_tokens=4, n=1, temperature=0.0)
    out_n = PolicyRolloutEngine(native.eval(), proc.tokenizer, EngineOptions(eos_token_ids=[-1])).generate(prompts, params)
    out_m = PolicyRolloutEngine(mc.eval(), proc.tokenizer, EngineOptions(eos_token_ids=[-1])).generate(prompts, params)
    assert [s.token_ids.tolist() for s in out_m.samples] == [s.token_ids.tolist() for s in out_n.samples]
    torch.testing.assert_close(torch.cat([s.logprobs for s in out_m.samples]),
                               torch.cat([s.logprobs for s in out_n.samples]), atol=1e-5, rtol=0)
    ids = torch.randint(0, vocab, (2, 6), generator=g)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():  # a left-padded batch (Mamba2 padding masks, attention key padding)
        torch.testing.assert_close(mc(ids, attention_mask=mask)[mask.bool()],
                                   native(ids, attention_mask=mask)[mask.bool()], atol=1e-5, rtol=0)


def _moe_args(**kw):
    base = dict(vocab_size=64, hidden_size=32, layers_block_type=["moe"], num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, intermediate_size=48, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                moe_shared_expert_intermediate_size=16, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8,
                n_groups=2)
    base.update(kw)
    return NemotronHTextArgs(**base)


def _native_moe_model(args, seed=0):
    torch.manual_seed(seed)
    model = NemotronHTextModel(args)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    _with_expert_bias(model, seed + 1)
    return model


@pytest.mark.parametrize("variant", [dict(), dict(n_group=2, topk_group=1, routed_scaling_factor=2.5),
                                     dict(n_group=4, topk_group=2, num_experts_per_tok=4),
                                     dict(num_experts_per_tok=1, norm_topk_prob=False)])
def test_sigmoid_routing_variants_and_balancer(variant, mcore_state):
    """Nemotron-H / DeepSeek-V3 routing: expert bias, groups, routed scaling, shared expert, top-1; the
    balancer's loads, auxiliary loss and bias update through megatron-core's router."""
    args = _moe_args(**variant)
    native = _native_moe_model(args)
    mc = copy.deepcopy(native)
    mc.layers[0] = McoreHybridBlock(mc.layers[0], 0, args)
    x = torch.randn(3, 10, args.hidden_size, generator=torch.Generator().manual_seed(4))
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[0, :3] = False
    cfg = MoEConfig(aux_loss_coef=0.1, bias_update_rate=0.01, n_step_per_workload_report=1)
    outs, grads, balancers = [], [], []
    for model in (native, mc):
        balancer = MoELoadBalancer(model, cfg)
        model.train()
        out = model(x, attention_mask=mask)
        loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum() + balancer.aux_loss()
        loss.backward()
        outs.append(out.detach())
        grads.append(_grads(model))
        report = balancer.after_step(1)
        balancers.append((report, moe_layers(model)[0].gate.e_score_correction_bias.clone()))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=0)
    assert grads[1].keys() == grads[0].keys()
    for name in grads[0]:  # the auxiliary loss's gradient reaches the router through megatron-core's logits
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4, msg=name)
    (rep_n, bias_n), (rep_m, bias_m) = balancers
    assert rep_n[0] == rep_m[0]  # the load metrics (from the real tokens' loads) are the same
    torch.testing.assert_close(bias_m, bias_n, atol=0, rtol=0)  # the same in-place bias update
    back = mc.layers[0].native_state()
    assert all(torch.equal(back[k], v) for k, v in native.layers[0].state_dict().items())


@pytest.mark.parametrize("variant,feature", [
    (dict(n_group=2, topk_group=1, num_experts_per_tok=4), "group-limited routing"),
    (dict(num_experts_per_tok=2, norm_topk_prob=False), "norm_topk_prob=False"),
    (dict(num_experts_per_tok=1, norm_topk_prob=True), "norm_topk_prob=True"),
    (dict(moe_latent_size=16), "latent projections"),
    (dict(mlp_bias=True), "biases"),
])
def test_unmapped_routing_features_are_refused(variant, feature, mcore_state):
    args = _moe_args(**variant)
    with pytest.raises(McoreBackendError, match=f"parallel.backend = 'mcore'.*{feature}"):
        McoreHybridBlock(NemotronHTextModel(args).layers[0], 0, args)


def test_expert_bias_stays_fp32_and_is_the_balancers(mcore_state):
    args = _moe_args()
    block = McoreHybridBlock(_native_moe_model(args).layers[0], 0, args).to(torch.bfloat16)
    router = block.mcore.mlp.router
    assert router.weight.dtype == torch.bfloat16 and router.expert_bias.dtype == torch.float32
    assert moe_layers(block)[0].gate.e_score_correction_bias is router.expert_bias


class _TwoRankMesh:
    """Stands in for the world mesh's "tp" dim of size 2 (the refusal comes before any collective)."""

    def size(self):
        return 2

    def get_local_rank(self):
        return 0


class _ThreeRankMesh(_TwoRankMesh):
    def size(self):
        return 3


@pytest.mark.parametrize("kind,key", [("tiny_qwen3_vl_moe", "num_attention_heads"),
                                      ("tiny_nemotron_vl", "(num_attention_heads|mamba_num_heads|intermediate_size)")])
def test_tensor_parallel_sizes_not_divided_are_refused(kind, key, tmp_path, mcore_state):
    """tp = 3 divides none of the tiny models' head counts: refused (TPError, exit 2) naming the layer's size,
    before any collective (the stand-in mesh has none). The 2-process tp = 2 runs of these models:
    tests/integration/parallel/test_mcore_tp_moe_hybrid.py."""
    from megatron_vlm.parallel.tensor_parallel import TPError

    model = load_hf_model(str(synthesize_model_folder(kind, tmp_path / kind, seed=0)), dtype=torch.float32)
    with pytest.raises(TPError, match=f"parallel.tp=3 does not divide language_model.layers.\\d+.{key}="):
        use_mcore_layers(model, tp_mesh=_ThreeRankMesh())


class _CpMesh:
    """Stands in for the world mesh's "cp" dim of size 2 (`apply_cp` only stores the group: no collective)."""

    mesh_dim_names = ("cp",)

    def __getitem__(self, name):
        return self

    def get_group(self):
        return None

    def get_local_rank(self):
        return 0


@pytest.mark.parametrize("kind", ["tiny_qwen3_vl_moe", "tiny_nemotron_vl"])
def test_context_parallel_splits_the_layers_native_splits(kind, tmp_path, mcore_state):
    """cp = 2 with MoE / hybrid megatron-core decoders: the family's cp step wraps the same layers as for the native
    model (every one but the Mamba2 blocks, which run the whole sequence) and hands the attention its cp group.
    The numerics, 2 processes: tests/integration/parallel/test_mcore_cp_moe_hybrid.py."""
    from megatron_vlm.models.common.parallel_plan import _apply_context_parallel
    from megatron_vlm.models.mcore.layer import McoreDecoderLayer

    folder = synthesize_model_folder(kind, tmp_path / kind, seed=0)
    native, model = (load_hf_model(str(folder), dtype=torch.float32) for _ in range(2))
    use_mcore_layers(model)
    for m in (native, model):
        _apply_context_parallel(m, 2, _CpMesh())
    split = [getattr(layer, "_mvlm_cp", False) for layer in model.language_model.layers]
    assert split == [getattr(layer, "_mvlm_cp", False) for layer in native.language_model.layers]
    for layer, cut in zip(model.language_model.layers, split):
        mamba = getattr(layer, "block_type", None) == "linear_attention"
        assert cut != mamba and isinstance(layer, (McoreDecoderLayer, McoreHybridBlock))
        attends = isinstance(layer, McoreDecoderLayer) or layer.block_type == "full_attention"
        if attends:
            assert layer.context_parallel is not None and layer.context_parallel.size == 2
    assert any(not cut for cut in split) == (kind == "tiny_nemotron_vl")


def test_context_parallel_with_expert_parallel_is_refused():
    """cp > 1 with ep > 1 is refused for both backends (config validation, exit 2), naming both keys."""
    from megatron_vlm.config.sections import ParallelConfig

    for backend in ("native", "mcore"):
        with pytest.raises(ValueError, match=r"cp: context parallelism \(cp = 2\) with expert parallelism \(ep = 2\)"):
            ParallelConfig(backend=backend, cp=2, ep=2).validate()


class _EpMesh:
    """Stands in for the ("ep_replicate", "ep") mesh with ep = 2 (the refusals come before any collective)."""

    ndim = 2

    def size(self, dim=None):
        return 2 if dim == 1 else 1


def test_expert_parallel_dense_decoders_are_refused(tmp_path, mcore_state):
    model = load_hf_model(str(synthesize_model_folder("tiny_qwen3", tmp_path / "q", seed=0)), dtype=torch.float32)
    for tp_mesh in (None, _TwoRankMesh()):  # with or without tp, before any collective
        with pytest.raises(McoreBackendError, match="parallel.ep = 2: the model has no MoE layers"):
            use_mcore_layers(model, tp_mesh=tp_mesh, ep_mesh=_EpMesh())
