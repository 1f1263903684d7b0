"""`parallel.backend = "mcore"` with pipeline stages, in one process: megatron-core layers converted first, then
`split_model_for_stage` keeps each stage's part. Checked against the native model (no code under test makes the
expected values): each stage holds megatron-core layers of its own range only, with their global layer_number; the
stages' parameter names together are the pp = 1 megatron-core names (checkpoint keys resume across pp); each
stage's state converted back with `native_state_dict` on its own model (what the HF export does per stage) gives,
together, the native state dict bit-exactly, and converting the merged dict again changes nothing; chaining
the stages' forwards gives the native model's token log-probs and the same weight gradients."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_vlm.checkpoint.hf import load_hf_model  # noqa: E402
from megatron_vlm.models.mcore.hybrid import McoreHybridBlock  # noqa: E402
from megatron_vlm.models.mcore.layer import McoreDecoderLayer, native_state_dict, use_mcore_layers  # noqa: E402
from megatron_vlm.parallel.pipeline import split_model_for_stage, stage_layer_range  # noqa: E402
from megatron_vlm.testing.synthesize import synthesize_model_folder  # noqa: E402
from megatron_vlm.training.lm_loss import TokenLogprobModel  # noqa: E402

_MCORE = (McoreDecoderLayer, McoreHybridBlock)


def _batch(vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, 23), generator=g)
    labels = torch.randint(3, vocab, (1, 23), generator=g)
    labels[0, ::4] = -100
    return {"input_ids": ids, "cu_seqlens": torch.tensor([0, 9, 23], dtype=torch.int32), "labels": labels}


@pytest.mark.parametrize("name", ["tiny_qwen3", "tiny_nemotron_vl"])
def test_mcore_stages_hold_their_layers_export_and_chain_like_native(name, mcore_state, tmp_path):
    folder = synthesize_model_folder(name, tmp_path / name, seed=0)
    native = TokenLogprobModel(load_hf_model(str(folder), dtype=torch.float32)).train()
    ref_state = native.model.state_dict()
    whole = load_hf_model(str(folder), dtype=torch.float32)
    use_mcore_layers(whole)
    whole_names = {n for n, _ in whole.named_parameters(remove_duplicate=False)}  # a tied lm_head under both names
    n = len(whole.language_model.layers)
    pp = 2
    stages, exported = [], {}
    for s in range(pp):
        model = load_hf_model(str(folder), dtype=torch.float32)
        use_mcore_layers(model)  # the order of model_bundle: megatron-core layers first, then the stage split
        stage = split_model_for_stage(model, TokenLogprobModel, stage=s, pp=pp, max_tokens=32, act_dtype=torch.float32)
        lo, hi = stage_layer_range(n, pp, s)
        for i, layer in enumerate(model.language_model.layers):
            assert isinstance(layer, _MCORE) == (lo <= i < hi), (s, i, type(layer).__name__)
            if lo <= i < hi:  # megatron-core numbers its layers from 1, globally (its own pipeline size is 1)
                assert layer.mcore.layer_number == i + 1, (s, i, layer.mcore.layer_number)
        names = {k.removeprefix("model.") for k, _ in stage.named_parameters(remove_duplicate=False)}
        assert names <= whole_names and any(".mcore." in k for k in names), sorted(names - whole_names)[:5]
        stages.append((stage.train(), names))
        exported.update(native_state_dict(model.state_dict(), model))  # each stage converts its own layers
    assert stages[0][1] | stages[1][1] == whole_names
    assert exported.keys() == ref_state.keys(), sorted(set(exported) ^ set(ref_state))[:5]
    assert all(torch.equal(exported[k], ref_state[k]) for k in ref_state)
    again = native_state_dict(dict(exported), stages[0][0].model)  # the export's second pass: a no-op
    assert again.keys() == exported.keys() and all(again[k] is exported[k] for k in exported)

    batch = _batch(native.model.lm_head.weight.shape[0])
    ref = native(batch)
    (-ref.sum()).backward()
    first, last = stages[0][0], stages[1][0]
    for st in (first, last):
        st.loss_scale, st.logp_sums = 1.0, []
    act = first(torch.zeros(1), batch=batch)
    recv = act.detach().requires_grad_(True)
    loss = last(recv, batch=batch)
    torch.testing.assert_close(loss, -ref.sum().reshape(1), rtol=1e-6, atol=1e-5)
    loss.backward()
    act.backward(recv.grad)
    emb = native.model._input_embeddings().weight
    tied_name = next((k for k, p in native.model.named_parameters() if p is emb), None) \
        if native.model.lm_head.weight is emb else None
    ref_grads = {k: p.grad for k, p in native.model.named_parameters() if p.grad is not None}
    got = {}
    for st, _ in stages:
        m = st.model
        grads = {k: p.grad for k, p in m.named_parameters() if p.grad is not None}
        for k, g in native_state_dict(grads, m).items():
            k = tied_name if k == "lm_head.weight" and tied_name else k  # the last stage's copy of a tied weight
            got[k] = got[k] + g if k in got else g  # a tied embedding / lm_head: both stages' parts summed
    assert got.keys() == ref_grads.keys(), sorted(set(got) ^ set(ref_grads))[:5]
    for k in ref_grads:
        torch.testing.assert_close(got[k], ref_grads[k], atol=1e-5, rtol=1e-4, msg=k)
