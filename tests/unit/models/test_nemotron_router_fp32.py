"""Nemotron-H routers keep fp32 weights in a bf16 model, as transformers keeps them (`gate.weight` in its
`_keep_in_fp32_modules_strict`): on load, under FSDP2's bf16 mixed precision and in a bf16 export. Rounded to
bf16, the same router input picked other experts than transformers' bf16 model for ~1 % of tokens."""
import pytest
import torch
from safetensors import safe_open
from test_nemotron_h import TEXT_CFG, randomise_
from transformers import NemotronHConfig, NemotronHForCausalLM

from megatron_vlm.checkpoint.hf import load_hf_model, save_hf_model
from megatron_vlm.models.common.moe import TopKRouter

# wider than the parity test's config: enough experts and tokens that bf16 rounding of the weight moves routes
CFG = dict(TEXT_CFG, hidden_size=128, num_attention_heads=4, head_dim=32, mamba_num_heads=4, mamba_head_dim=32,
           n_routed_experts=32, num_experts_per_tok=4, n_group=1, topk_group=1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    hf = NemotronHForCausalLM(NemotronHConfig(**CFG)).eval()
    randomise_(hf)
    path = tmp_path_factory.mktemp("nemotron_h_fp32_router")
    hf.save_pretrained(path)
    gates = {n: p.detach().clone() for n, p in hf.named_parameters() if n.endswith("mixer.gate.weight")}
    return path, gates


def _routers(model):
    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def test_bf16_load_keeps_the_checkpoints_fp32_router_weights(folder):
    path, gates = folder
    ours = load_hf_model(path, dtype=torch.bfloat16)
    routers = _routers(ours)
    assert len(routers) == len(gates) == 2
    for router, ref in zip(routers, gates.values()):
        assert router.weight.dtype == torch.float32
        assert torch.equal(router.weight.detach(), ref)  # the checkpoint's values, not a cast back from bf16
    assert ours.lm_head.weight.dtype == torch.bfloat16
    ours.to(torch.bfloat16)  # a later cast keeps them too
    assert all(torch.equal(r.weight.detach(), ref) for r, ref in zip(_routers(ours), gates.values()))


def test_same_router_input_routes_as_transformers_bf16(folder):
    path, _ = folder
    hf = NemotronHForCausalLM.from_pretrained(path, dtype=torch.bfloat16, experts_implementation="eager").eval()
    hf_routers = [m for m in hf.modules() if type(m).__name__ == "NemotronHTopkRouter"]
    assert all(r.weight.dtype == torch.float32 for r in hf_routers)  # what transformers keeps
    ours = load_hf_model(path, dtype=torch.bfloat16).eval()
    # a bf16 router input (what a bf16 decoder hands the router), 256 tokens
    x = torch.randn(256, CFG["hidden_size"], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        for theirs, mine in zip(hf_routers, _routers(ours)):
            _, ref_w, ref_ids = theirs(x)
            _, w, topk = mine(x)
            assert torch.equal(topk.sort(-1).values, ref_ids.sort(-1).values)
            torch.testing.assert_close(w.gather(1, topk.argsort(-1)), ref_w.gather(1, ref_ids.argsort(-1)))


def test_bf16_export_keeps_router_weights_and_biases_fp32(folder, tmp_path):
    path, gates = folder
    out = save_hf_model(load_hf_model(path), tmp_path / "export", dtype=torch.bfloat16)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = f.keys()
        dtypes = {k: f.get_tensor(k).dtype for k in names}
        fp32 = {k for k, d in dtypes.items() if d == torch.float32}
        for name, ref in gates.items():  # transformers' in-memory names (model.layers.*) end the file's
            (key,) = [k for k in dtypes if k.endswith(name.split(".", 1)[1])]
            assert torch.equal(f.get_tensor(key), ref)
    suffixes = {n.split(".", 1)[1] for n in gates} | {n.split(".", 1)[1].replace(".weight", ".e_score_correction_bias")
                                                       for n in gates}
    assert {k.split(".", 1)[1] for k in fp32} == suffixes
    assert dtypes["lm_head.weight"] == torch.bfloat16



def test_fsdp_bf16_mixed_precision_gathers_routers_in_fp32(folder, gloo_world_of_one):
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_vlm.parallel import apply_fsdp

    path, gates = folder
    model = load_hf_model(path).eval()
    reference = [TopKRouter(CFG["hidden_size"], CFG["n_routed_experts"], CFG["num_experts_per_tok"],
                            score_func="sigmoid", routed_scaling_factor=CFG["routed_scaling_factor"]) for _ in gates]
    for ref, r in zip(reference, _routers(model)):
        ref.load_state_dict(r.state_dict())
    apply_fsdp(model, init_device_mesh("cpu", (1,)), list(model.transformer_blocks()), param_dtype=torch.bfloat16)
    calls = []
    for router in _routers(model):
        router.register_forward_hook(lambda mod, args, out: calls.append((mod.weight.dtype, args[0], out)))
    with torch.no_grad():
        model(torch.randint(1, 96, (2, 16), generator=torch.Generator().manual_seed(2)))
    assert len(calls) == 2
    for (dtype, x, (scores, _, _)), ref in zip(calls, reference):
        assert dtype == torch.float32  # gathered unrounded
        ref_scores, _, _ = ref(x)
        torch.testing.assert_close(scores, ref_scores, rtol=0, atol=0)
