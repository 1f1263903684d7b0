"""A model folder whose config.json names remote code (`auto_map`, as NVIDIA's Nemotron Nano VL releases and other
`trust_remote_code` models ship) keeps that `auto_map` in the export, so the export must carry the code files too:
without them `from_pretrained(export, trust_remote_code=True)` (transformers, vLLM) stopped at the missing module.
Reference: transformers' own remote-code loader on the exported folder, with the logits of our model."""
from __future__ import annotations

import json

import torch

from megatron_vlm.checkpoint.hf import load_hf_model, save_hf_model
from megatron_vlm.testing.synthesize import synthesize_model_folder

CONFIG_CODE = '''from transformers import Qwen2Config


class RemoteQwen2Config(Qwen2Config):
    model_type = "qwen2"
'''
MODEL_CODE = '''from transformers import Qwen2ForCausalLM

from .configuration_remote import RemoteQwen2Config


class RemoteQwen2ForCausalLM(Qwen2ForCausalLM):
    config_class = RemoteQwen2Config
'''


def _remote_code_folder(tmp_path):
    src = synthesize_model_folder("tiny_qwen2", tmp_path / "src", seed=2)
    (src / "configuration_remote.py").write_text(CONFIG_CODE)
    (src / "modeling_remote.py").write_text(MODEL_CODE)
    cfg = json.loads((src / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_remote.RemoteQwen2Config",
                       "AutoModelForCausalLM": "modeling_remote.RemoteQwen2ForCausalLM"}
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def test_an_export_of_a_remote_code_model_loads_with_its_code(tmp_path):
    import transformers

    src = _remote_code_folder(tmp_path)
    ours = load_hf_model(src).eval()
    out = save_hf_model(ours, tmp_path / "export", copy_from=src)
    assert {"configuration_remote.py", "modeling_remote.py"} <= {p.name for p in out.iterdir()}
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(hf).__name__ == "RemoteQwen2ForCausalLM"
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_code_files_are_copied_only_for_a_folder_that_names_remote_code(tmp_path):
    src = synthesize_model_folder("tiny_qwen2", tmp_path / "src", seed=2)
    (src / "helper.py").write_text("x = 1\n")  # no auto_map: a stray script, not the model's code
    out = save_hf_model(load_hf_model(src), tmp_path / "export", copy_from=src)
    assert not (out / "helper.py").exists()
