"""A reward model folder's config.json: the dtype its tensors are in, the pad token id, transformers' class name.

A reward run from a hub model (config.json: bfloat16) trains fp32 weights and exports them fp32; the folder kept
the source's "bfloat16", so transformers' `dtype="auto"` (and vLLM) scored in bf16, not with the trained weights.
"""
from __future__ import annotations

import json

import pytest
import torch

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.testing.tiny_text_model import build_tiny_qwen_text_folder
from megatron_vlm.training.reward.export import export_score_folder
from megatron_vlm.training.reward.model import ScoreRoot
from tests.fixtures.hf_scores import hf_scores


def test_reward_export_config_names_the_written_dtype(tmp_path):
    import transformers

    folder = build_tiny_qwen_text_folder(tmp_path / "causal", model_type="qwen2", seed=4)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))  # as hub checkpoints say
    root = ScoreRoot(load_hf_model(folder, dtype=torch.float32), std=0.5, seed=1).eval()
    out = tmp_path / "hf"
    export_score_folder(root.state_dict(), root.model, out, copy_from=folder)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(5, 200, (n,), generator=g) for n in (9, 4, 13)]
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype="auto").eval()
    assert hf.score.weight.dtype == torch.float32
    with torch.no_grad():
        ours = root({"input_ids": torch.cat(seqs)[None], "cu_seqlens": torch.tensor([0, 9, 13, 26], dtype=torch.int32)})
    torch.testing.assert_close(hf_scores(hf, seqs), ours, rtol=1e-5, atol=1e-5)


def test_reward_export_of_a_model_without_pad_token_id_scores_batches_in_transformers(tmp_path):
    """Qwen2.5 / Qwen3 config.json files name no pad_token_id (their tokenizers do): transformers'
    `...ForSequenceClassification` then refuses any batch of more than one sequence. The export takes the
    tokenizer's pad token id, as transformers needs to find each row's last token."""
    import transformers

    folder = build_tiny_qwen_text_folder(tmp_path / "causal", model_type="qwen2", seed=5)
    config = json.loads((folder / "config.json").read_text())
    config.pop("pad_token_id")
    (folder / "config.json").write_text(json.dumps(config))
    root = ScoreRoot(load_hf_model(folder, dtype=torch.float32), std=0.5, seed=1).eval()
    out = tmp_path / "hf"
    export_score_folder(root.state_dict(), root.model, out, copy_from=folder)
    pad = transformers.AutoTokenizer.from_pretrained(folder).pad_token_id
    assert pad is not None and json.loads((out / "config.json").read_text())["pad_token_id"] == pad

    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(5, 200, (n,), generator=g) for n in (9, 4, 13)]
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = root({"input_ids": torch.cat(seqs)[None], "cu_seqlens": torch.tensor([0, 9, 13, 26], dtype=torch.int32)})
    torch.testing.assert_close(hf_scores(hf, seqs), ours, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3_moe"])
def test_reward_export_of_a_text_family_names_transformers_class(tmp_path, model_type):
    """vLLM picks the model class by config.json's `architectures`; a text family's reward folder must name
    transformers' `<Family>ForSequenceClassification` (it named `QwenTextForSequenceClassification`, our module's
    name, which neither vLLM nor transformers knows)."""
    import transformers

    folder = build_tiny_qwen_text_folder(tmp_path / "causal", model_type=model_type, seed=4)
    root = ScoreRoot(load_hf_model(folder, dtype=torch.float32), std=0.5, seed=1).eval()
    export_score_folder(root.state_dict(), root.model, tmp_path / "hf", copy_from=folder)
    (arch,) = json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"]
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf")
    assert arch == type(hf).__name__ and getattr(transformers, arch) is type(hf)


def test_reward_export_in_bfloat16(tmp_path):
    """`checkpoint.export_dtype = "bfloat16"` for a reward model: bf16 tensors but the score head (fp32, as training
    computes it and our scorer reads it: training/reward/model.py `ScoreHead`), config.json says bfloat16, and
    transformers loads the folder as a bf16 model and scores close to the fp32 scores."""
    import transformers
    from safetensors.torch import load_file

    folder = build_tiny_qwen_text_folder(tmp_path / "causal", model_type="qwen2", seed=4)
    root = ScoreRoot(load_hf_model(folder, dtype=torch.float32), std=0.5, seed=1).eval()
    out = tmp_path / "hf"
    export_score_folder(root.state_dict(), root.model, out, copy_from=folder, dtype=torch.bfloat16)
    stored = load_file(out / "model.safetensors")
    assert {t.dtype for k, t in stored.items() if k != "score.weight"} == {torch.bfloat16}
    assert stored["score.weight"].dtype == torch.float32
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype="auto").eval()
    assert hf.score.weight.dtype == torch.bfloat16
    seqs = [torch.randint(5, 200, (n,), generator=torch.Generator().manual_seed(0)) for n in (9, 4)]
    with torch.no_grad():
        ours = root({"input_ids": torch.cat(seqs)[None], "cu_seqlens": torch.tensor([0, 9, 13], dtype=torch.int32)})
    torch.testing.assert_close(hf_scores(hf, seqs).float(), ours, rtol=0.05, atol=0.05)
