"""`launch/convert_checkpoint.py` on a reward-model run's checkpoint (`train.mode = "reward"`).

It used to read the checkpoint into the causal model (`lm_head` missing from the checkpoint) and exit 2 calling a
sound checkpoint "another size than the checkpoint's, or a damaged shard". It now writes the sequence-
classification folder the run exports at the end: transformers' own `Qwen2ForSequenceClassification` loads it, and
its logits equal the trained `ScoreRoot`'s rewards.
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace as NS

import torch

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.checkpoint.layout import run_layout
from megatron_vlm.checkpoint.manager import CheckpointManager
from megatron_vlm.training.reward.model import ScoreRoot
from tests.fixtures.hf_scores import hf_scores

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "launch"))
import convert_checkpoint  # noqa: E402


def test_a_reward_checkpoint_converts_to_a_folder_transformers_scores_as_training_did(tmp_path, capsys):
    import transformers

    from megatron_vlm.testing.tiny_text_model import build_tiny_qwen_text_folder

    folder = build_tiny_qwen_text_folder(tmp_path / "causal", model_type="qwen2", seed=4)
    root = ScoreRoot(load_hf_model(folder, dtype=torch.float32, device="cpu"), std=0.5, seed=1)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(5, 200, (n,), generator=g) for n in (9, 4, 13)]
    cu = torch.tensor([0, 9, 13, 26], dtype=torch.int32)
    batch = {"input_ids": torch.cat(seqs)[None], "cu_seqlens": cu}
    opt = torch.optim.AdamW(root.parameters(), lr=1e-2)
    root.train()
    root(batch).pow(2).sum().backward()  # one step: backbone and head differ from model.path's and from their initial values
    opt.step()
    layout = run_layout(NS(model=NS(path=str(folder)), lora=None, train=NS(train_layers=[])), model_type="qwen2",
                        world_size=1, mcore_tp=None, mcore_ep=None)
    CheckpointManager(tmp_path / "run", keep_last=0, rank=0).save(1, root, opt, {"data": {}}, layout=layout)
    root.eval()
    with torch.no_grad():
        ours = root(batch)

    out = tmp_path / "converted"
    code = convert_checkpoint.main(["--checkpoint", str(tmp_path / "run" / "checkpoints" / "step_1"), "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    hf = transformers.Qwen2ForSequenceClassification.from_pretrained(out).eval()
    assert hf.config.num_labels == 1 and (out / ".export_complete").is_file()
    ref = hf_scores(hf, seqs)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert ref.std() > 1e-3


def test_a_bf16_reward_checkpoint_converts_to_the_folder_its_run_exports(tmp_path, capsys):
    """`model.dtype = "bfloat16"`, no export_dtype: the run exports its backbone as held (bf16) and its fp32 head; the
    converter built an fp32 backbone and wrote it in fp32. Reference: the run's export (`export_score_folder` of
    the held state, no dtype), read back by safetensors."""
    from safetensors.torch import load_file

    from megatron_vlm.testing.tiny_text_model import build_tiny_qwen_text_folder
    from megatron_vlm.training.reward.export import export_score_folder

    folder = build_tiny_qwen_text_folder(tmp_path / "causal", model_type="qwen2", seed=4)
    root = ScoreRoot(load_hf_model(folder, dtype=torch.bfloat16, device="cpu"), std=0.5, seed=1)
    opt = torch.optim.AdamW(root.parameters(), lr=1e-2)
    layout = run_layout(NS(model=NS(path=str(folder)), lora=None, train=NS(train_layers=[])), model_type="qwen2",
                        world_size=1, mcore_tp=None, mcore_ep=None)
    CheckpointManager(tmp_path / "run", keep_last=0, rank=0).save(1, root, opt, {"data": {}}, layout=layout)
    (tmp_path / "run" / "config.toml").write_text(f'[model]\npath = "{folder}"\ndtype = "bfloat16"\n')
    export_score_folder(root.state_dict(), root.model, tmp_path / "own", copy_from=folder)
    out = tmp_path / "converted"
    code = convert_checkpoint.main(["--checkpoint", str(tmp_path / "run" / "checkpoints" / "step_1"), "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    own, conv = load_file(tmp_path / "own" / "model.safetensors"), load_file(out / "model.safetensors")
    assert own["score.weight"].dtype == torch.float32 and {v.dtype for k, v in own.items() if k != "score.weight"} == {torch.bfloat16}
    assert own.keys() == conv.keys() and all(conv[k].dtype == own[k].dtype and torch.equal(own[k], conv[k]) for k in own)
