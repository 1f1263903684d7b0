"""`launch/convert_checkpoint.py` on a checkpoint of a `parallel.backend = "mcore"` run.

Its decoder layers are saved under megatron-core's names (`layers.<i>.mcore.self_attention.linear_qkv.weight`
...). The converter used to read them into the native model and exit 2 calling a sound checkpoint "another size
than the checkpoint's, or a damaged shard". It now converts them as the run's own export does: transformers loads
the folder with the logits of the trained megatron-core model.
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
from torch import nn

pytest.importorskip("megatron.core")  # installed by the dev extra

from megatron_vlm.checkpoint.hf import load_hf_model  # noqa: E402
from megatron_vlm.checkpoint.layout import run_layout  # noqa: E402
from megatron_vlm.checkpoint.manager import CheckpointManager  # noqa: E402
from megatron_vlm.models.mcore.layer import use_mcore_layers  # noqa: E402
from megatron_vlm.testing.tiny_text_model import build_tiny_qwen_text_folder  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "launch"))
import convert_checkpoint  # noqa: E402


class _Wrapper(nn.Module):
    """The training wrapper's layout: the family model under `.model` (checkpoint keys `model.<name>`)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, mcore_state):
    """(step folder, the trained megatron-core model): a tiny Qwen3-MoE run's checkpoint, parallel.backend = mcore."""
    tmp = tmp_path_factory.mktemp("mcore_ckpt")
    folder = build_tiny_qwen_text_folder(tmp / "base", model_type="qwen3_moe", seed=2)
    model = load_hf_model(folder).eval()
    use_mcore_layers(model)
    with torch.no_grad():  # trained: every weight differs from model.path's
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    layout = run_layout(NS(model=NS(path=str(folder)), lora=None, train=NS(train_layers=[]),
                           parallel=NS(backend="mcore", tp=1, cp=1, ep=1, pp=1)),
                        model_type="qwen3_moe", world_size=1, mcore_tp=1, mcore_ep=1)
    wrapper = _Wrapper(model)
    opt = torch.optim.AdamW(wrapper.parameters(), lr=1e-3)
    CheckpointManager(tmp / "run", keep_last=0, rank=0).save(1, wrapper, opt, {"data": {}}, layout=layout)
    return tmp / "run" / "checkpoints" / "step_1", model


def test_an_mcore_checkpoint_converts_to_a_folder_transformers_runs_as_trained(checkpoint, tmp_path, capsys):
    import transformers

    step, model = checkpoint
    ids = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)
    out = tmp_path / "converted"
    code = convert_checkpoint.main(["--checkpoint", str(step), "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, ours, rtol=1e-4, atol=1e-4)


def test_without_megatron_core_the_error_says_what_is_missing(checkpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron_vlm.models.mcore.layer", None)  # as where it is not installed
    code = convert_checkpoint.main(["--checkpoint", str(checkpoint[0]), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "needs megatron-core" in err and 'parallel.backend = "mcore"' in err, err
    assert not (tmp_path / "out").exists()
