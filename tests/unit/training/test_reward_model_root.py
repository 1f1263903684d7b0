"""Reward-model training's model side: the `ScoreRoot` rewards, its export and the `type = "model"` scorer agree.

- the export of a ScoreRoot on a tiny Qwen2 text backbone is a folder transformers' own
  `Qwen2ForSequenceClassification` loads, and its logits (padded batch, transformers' pooling) equal the rewards
  the training root computed on the same sequences packed (the reference nobody here wrote);
- on a tiny Qwen2.5-VL, the export scored through `ModelRewardScorer` (our loader, the rendering of the
  `[[rl.rewards]] type = "model"` reward) equals the training root's rewards of the same conversations as the
  preference loader packs them;
- one packed forward over pairs gives each sequence the reward it gets alone (images kept apart);
- in training mode the zero-valued anchor gives every trainable parameter a gradient even for a pack with no
  image (what FSDP's reduce-scatter needs on every rank), and leaves the rewards unchanged.
"""
from __future__ import annotations

import pytest
import torch

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.training.reward.export import export_score_folder
from megatron_vlm.training.reward.model import ScoreRoot, head_std
from tests.fixtures.hf_scores import hf_scores


@pytest.fixture(scope="module")
def tiny_vlm_folder(tmp_path_factory):
    from megatron_vlm.testing.tiny_model import build_tiny_model_folder

    return build_tiny_model_folder("tiny_qwen2_5_vl", tmp_path_factory.mktemp("tiny_vlm") / "vl", seed=3)


def _root(folder, std=0.5):
    return ScoreRoot(load_hf_model(folder, dtype=torch.float32, device="cpu"), std=std, seed=1).eval()


def test_export_loads_in_transformers_with_the_training_rewards(tmp_path):
    import transformers

    from megatron_vlm.testing.tiny_text_model import build_tiny_qwen_text_folder

    folder = build_tiny_qwen_text_folder(tmp_path / "causal", model_type="qwen2", seed=4)
    root = _root(folder)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(5, 200, (n,), generator=g) for n in (9, 4, 13)]
    cu = torch.tensor([0, 9, 13, 26], dtype=torch.int32)
    with torch.no_grad():
        ours = root({"input_ids": torch.cat(seqs)[None], "cu_seqlens": cu})
    export_score_folder(root.state_dict(), root.model, tmp_path / "rm", copy_from=folder)
    hf = transformers.Qwen2ForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    assert hf.config.num_labels == 1
    ref = hf_scores(hf, seqs)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert ref.std() > 1e-3
    assert (tmp_path / "rm" / ".export_complete").is_file()


def test_exported_vlm_scores_through_the_model_reward_as_in_training(tmp_path, tiny_vlm_folder):
    from megatron_vlm.data.config import DataConfig
    from megatron_vlm.data.preference_loader import build_preference_pass_loader
    from megatron_vlm.data.preference_records import SyntheticPreferencePairs
    from megatron_vlm.data.processor import load_processor
    from megatron_vlm.data.sources import open_split
    from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa
    from megatron_vlm.rl.rewards.config import ModelRewardConfig
    from megatron_vlm.rl.rewards.model_reward import ModelRewardScorer
    from megatron_vlm.testing.reward_model_vqa import vqa_pairs
    from megatron_vlm.training.reward.step import pair_rewards

    data = tmp_path / "data"
    write_synthetic_vqa(data, 8, 6, seed=0, image_size=56)
    cfg = DataConfig(type="synthetic_vqa", synthetic_dir=str(data), synthetic_train_size=8, synthetic_eval_size=6,
                     max_tokens_per_pack=1024, num_workers=0)
    root = _root(tiny_vlm_folder, std=1.0)
    processor = load_processor(tiny_vlm_folder)
    trained = []
    with torch.no_grad():
        for pack in build_preference_pass_loader(cfg, processor, split="eval", dp_rank=0, dp_size=1):
            if int(pack["num_pairs"]):
                c, r = pair_rewards(root(pack), pack)
                trained += [(int(i), float(a), float(b)) for i, a, b in zip(pack["pair_index"], c, r)]
    assert len(trained) == 6
    export_score_folder(root.state_dict(), root.model, tmp_path / "rm", copy_from=tiny_vlm_folder)
    scorer = ModelRewardScorer(ModelRewardConfig(path=str(tmp_path / "rm"), activation="none", batch_size=4))
    pairs = SyntheticPreferencePairs(open_split(cfg, "eval"), seed=cfg.synthetic_seed)
    prompts = vqa_pairs(data / "eval.jsonl")  # the prompt turns with absolute image paths
    for i, chosen, rejected in trained:
        rec = pairs.get(i)
        msgs = prompts[i][0]
        got = scorer.score([rec.chosen, rec.rejected], [msgs, msgs])
        assert got.status == ["ok", "ok"]
        assert got.values == pytest.approx([chosen, rejected], abs=1e-5), i


def test_anchor_gives_every_trainable_parameter_a_gradient(tiny_vlm_folder):
    root = _root(tiny_vlm_folder)
    root.train()
    pack = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10]]), "cu_seqlens": torch.tensor([0, 2, 6], dtype=torch.int32)}
    rewards = root(pack)  # text only: the vision tower does not run
    with torch.no_grad():
        torch.testing.assert_close(rewards, root.eval()(pack))
    root.train()
    (root(pack).sum() * 0.0).backward()
    missing = [n for n, p in root.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing[:5]
    assert root.score.weight.shape == (1, root.model.language_model.embed_tokens.weight.shape[1])


def test_head_std_from_the_config():
    assert head_std({"initializer_range": 0.05}, 0.0) == 0.05
    assert head_std({"text_config": {"initializer_range": 0.01}}, 0.0) == 0.01
    assert head_std({}, 0.0) == 0.02 and head_std({"initializer_range": 0.05}, 0.3) == 0.3


def test_one_packed_forward_of_pairs_equals_each_sequence_alone(tmp_path, tiny_vlm_folder):
    """A pack of pairs (chosen, rejected, ... with their images) scored in ONE varlen forward gives each sequence the
    reward it gets alone: `cu_seqlens` keeps sequences and images apart, the last token of each is pooled.

    The trunk runs in fp64 so that packing is the only difference; the score head is fp32 by design, and its dot
    product over one row and over a pack of rows takes different fp32 kernels (up to ~7e-6 apart on some CPUs), so
    here it runs in fp64 too (the head computes in its weight's dtype)."""
    from megatron_vlm.data.config import DataConfig
    from megatron_vlm.data.packing import collate_pack
    from megatron_vlm.data.preference_loader import build_preference_dataloader
    from megatron_vlm.data.processing import ProcessedSample
    from megatron_vlm.data.processor import load_processor
    from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa
    from megatron_vlm.training.reward.step import pair_rewards

    cfg = DataConfig(type="synthetic_vqa", synthetic_dir=str(tmp_path / "data"), synthetic_train_size=12,
                     synthetic_eval_size=0, max_tokens_per_pack=512, num_workers=0, shuffle=False)
    write_synthetic_vqa(tmp_path / "data", 12, 0, seed=0, image_size=56)
    pack = next(iter(build_preference_dataloader(cfg, load_processor(tiny_vlm_folder), seed=0, dp_rank=0, dp_size=1)))
    pairs = int(pack["num_pairs"])
    assert pairs >= 3
    root = ScoreRoot(load_hf_model(tiny_vlm_folder, dtype=torch.float64, device="cpu"), std=1.0, seed=2).eval()
    root.score.double()
    per = int(pack["image_grid_thw"][0].prod())  # the synthetic images all have one size
    with torch.no_grad():
        chosen, rejected = pair_rewards(root(pack), pack)
        cu = pack["cu_seqlens"]
        for s in range(2 * pairs):
            a, b = int(cu[s]), int(cu[s + 1])
            alone = collate_pack([ProcessedSample(input_ids=pack["input_ids"][0, a:b],
                                                  label_mask=torch.zeros(b - a, dtype=torch.bool),
                                                  pixel_values=pack["pixel_values"][s * per:(s + 1) * per],
                                                  image_grid_thw=pack["image_grid_thw"][s:s + 1])])
            want = root(alone)[0]
            got = (chosen if s % 2 == 0 else rejected)[s // 2]
            torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(chosen, rejected)


def test_a_bf16_run_exports_what_it_scored_with(tmp_path, tiny_vlm_folder):
    """Mixed precision (bf16 compute from fp32 masters: `parallel.fsdp = false`'s MasterWeights, FSDP2's arithmetic
    on one rank) exports the fp32 masters, and the `type = "model"` scorer of a bf16 run computes the backbone in
    bf16 and its head in fp32. Training computed the head from its bf16 rounding, and the scorer took the rotary
    tables uncast (fp32): the exported folder scored other values than training did (up to a few % of a reward)."""
    from megatron_vlm.models.common.parallel_plan import unit_blocks
    from megatron_vlm.parallel.apply import apply_input_casts
    from megatron_vlm.parallel.master_weights import MasterWeights, fp32_view
    from megatron_vlm.rl.rewards.score_model import load_score_model

    root = _root(tiny_vlm_folder, std=1.0)
    MasterWeights(root, torch.bfloat16)
    apply_input_casts(root, unit_blocks(root.model), torch.bfloat16)  # as the job does without FSDP2
    pack = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10, 11]]),
            "cu_seqlens": torch.tensor([0, 3, 7], dtype=torch.int32)}
    with torch.no_grad():
        trained = root(pack)
    with fp32_view(root, writes=False):
        state = {k: v.detach().clone() for k, v in root.state_dict().items()}
    assert state["score.weight"].dtype == torch.float32  # the export holds the masters
    # as the run holds them (fp32 masters), and halved (checkpoint.export_dtype = "bfloat16": the head stays fp32)
    for name, dtype in (("rm", None), ("rm_bf16", torch.bfloat16)):
        export_score_folder(state, root.model, tmp_path / name, copy_from=tiny_vlm_folder, dtype=dtype)
        scorer = load_score_model(tmp_path / name, dtype=torch.bfloat16).eval()
        with torch.no_grad():
            scored = scorer(dict(pack))[:, 0]
        assert torch.equal(scored, trained), (name, scored, trained)


def test_fsdp_mixed_precision_trains_the_head_in_fp32(tmp_path, tiny_vlm_folder, gloo_world_of_one):
    """Under FSDP2's bf16 mixed precision the head is a unit of its own gathered in fp32: a training step (the
    zero-valued anchor included, which once read the resharded head and raised on mixing a DTensor) scores what
    the exported folder scores in a bf16 run, and the head gets its gradient."""
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_vlm.models.common.parallel_plan import unit_blocks
    from megatron_vlm.parallel import apply_fsdp
    from megatron_vlm.rl.rewards.score_model import load_score_model

    root = _root(tiny_vlm_folder, std=1.0).train()
    # as the families wrap it (models/common/parallel_plan.py): the decoder layers are units, the rest the root's
    apply_fsdp(root, init_device_mesh("cpu", (1,)), unit_blocks(root.model), param_dtype=torch.bfloat16)
    pack = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10, 11]]),
            "cu_seqlens": torch.tensor([0, 3, 7], dtype=torch.int32)}
    rewards = root(pack)
    rewards.sum().backward()
    assert root.score.weight.grad is not None and bool(root.score.weight.grad.full_tensor().abs().sum() > 0)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in root.state_dict().items()}
    export_score_folder(state, root.model, tmp_path / "rm", copy_from=tiny_vlm_folder)
    scorer = load_score_model(tmp_path / "rm", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        scored = scorer(dict(pack))[:, 0]
    assert torch.equal(scored, rewards.detach()), (scored, rewards)
