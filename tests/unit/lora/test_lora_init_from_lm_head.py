"""`lora.init_from` with an adapter that PEFT trained on the LM head as well (`target_modules` naming "lm_head",
saved without the embedding layers) is refused: training computes its loss from `lm_head.weight` directly (the
fused log-prob path, training/lm_loss.py), so an adapter there would get no gradient and be left out of every
training loss while the evaluation forward and the merged export used it. It used to be wrapped silently (with
lora.target_modules empty, the adapter's layers are adapted as they are)."""
from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

from megatron_vlm.checkpoint.hf import load_hf_model  # noqa: E402
from megatron_vlm.config.sections import LoRAConfig  # noqa: E402
from megatron_vlm.models.common.lora import lora_modules  # noqa: E402
from megatron_vlm.testing.synthesize import synthesize_model_folder  # noqa: E402
from megatron_vlm.training.lora import setup_lora  # noqa: E402


def _untied_model(tmp_path):
    """The tiny Qwen3 with its own LM head (the tiny one ties it to the embedding, which PEFT never adapts alone)."""
    import shutil

    import transformers

    tied = synthesize_model_folder("tiny_qwen3", tmp_path / "tied", seed=3)
    config = transformers.AutoConfig.from_pretrained(str(tied))
    config.tie_word_embeddings = False
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tied), config=config, dtype=torch.float32)
    with torch.no_grad():
        hf.lm_head.weight.copy_(0.05 * torch.randn(hf.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)))
    out = tmp_path / "src"
    hf.save_pretrained(str(out))
    for f in tied.iterdir():
        if f.is_file() and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return out


def _peft_adapter(src, out, targets):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():  # trained: B != 0
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(out), save_embedding_layers=False)
    return out, model.eval()


def test_an_adapter_on_the_lm_head_is_refused(tmp_path):
    src = _untied_model(tmp_path)
    adapter, _ = _peft_adapter(src, tmp_path / "adapter", ["q_proj", "lm_head"])
    model = load_hf_model(src)
    with pytest.raises(ValueError, match=r"lora\.init_from: .*lm_head"):
        setup_lora(model, LoRAConfig(r=4, alpha=8.0, init_from=str(adapter)), model.hf_config)


def test_an_adapter_without_it_continues(tmp_path):
    src = _untied_model(tmp_path)
    adapter, _ = _peft_adapter(src, tmp_path / "adapter", ["q_proj"])
    model = load_hf_model(src)
    setup_lora(model, LoRAConfig(r=4, alpha=8.0, init_from=str(adapter)), model.hf_config)
    assert sorted(lora_modules(model)) == [f"language_model.layers.{i}.self_attn.q_proj" for i in (0, 1)]


def test_merging_it_outside_training_gives_peft_logits(tmp_path):
    """The way out the refusal names: convert_checkpoint --adapter --merge folds it in, as PEFT computes it."""
    import transformers

    from launch.convert_checkpoint import main

    src = _untied_model(tmp_path)
    adapter, theirs = _peft_adapter(src, tmp_path / "adapter", ["q_proj", "lm_head"])
    assert main(["--adapter", str(adapter), "--model-path", str(src), "--merge", "--out", str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, theirs(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
