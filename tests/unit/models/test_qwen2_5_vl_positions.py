"""M-RoPE position ids and vision index helpers against transformers' own functions
(`Qwen2_5_VLModel.get_rope_index`, `transformers.vision_utils`)."""
import pytest
import torch
from transformers import vision_utils

from megatron_vlm.models.common.mrope_index import get_mrope_position_ids
from megatron_vlm.models.common.vision import vision_cu_seqlens, vision_hw_position_ids, vision_window_index
from tests.fixtures import tiny_qwen2_5_vl as F


@pytest.fixture(scope="module")
def hf_model():
    return F.hf_reference_model(seed=0, text_layers=1, vision_depth=2)


def _ours(batch, **kw):
    return get_mrope_position_ids(
        batch["input_ids"], image_token_id=F.IMAGE_TOKEN_ID, video_token_id=F.VIDEO_TOKEN_ID,
        spatial_merge_size=F.MERGE, tokens_per_second=2, image_grid_thw=batch["image_grid_thw"],
        video_grid_thw=batch["video_grid_thw"], **kw,
    )


def _ref(hf_model, batch, **kw):
    return hf_model.model.get_rope_index(
        batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"], image_grid_thw=batch["image_grid_thw"],
        video_grid_thw=batch["video_grid_thw"], **kw,
    )


CASES = {
    "image": [[3, ("image", (1, 4, 6)), 5]],
    "two_images_and_video": [[2, ("image", (1, 6, 4)), 3, ("video", (3, 4, 6)), 2, ("image", (1, 4, 8)), 4]],
    "vision_first_and_last": [[("image", (1, 4, 4)), 2, ("video", (2, 4, 4))]],
    "batch": [[3, ("image", (1, 4, 6)), 5], [7], [1, ("video", (4, 4, 4)), 2, ("image", (1, 8, 4)), 1]],
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_matches_get_rope_index(hf_model, name, padding_side):
    g = torch.Generator().manual_seed(0)
    batch = F.batch_samples([F.build_sample(p, g) for p in CASES[name]], padding_side=padding_side)
    n_videos = 0 if batch["video_grid_thw"] is None else len(batch["video_grid_thw"])
    secs = torch.tensor([1.5, 0.5, 2.0][:n_videos]) if n_videos else None
    mask = batch["attention_mask"]
    ref_pos, ref_delta = _ref(hf_model, batch, attention_mask=mask, second_per_grid_ts=secs)
    pos, delta = _ours(batch, attention_mask=mask, second_per_grid_ts=secs)
    assert torch.equal(pos[:, mask.bool()], ref_pos[:, mask.bool()])
    assert torch.equal(delta, ref_delta)
    # our result is the same whether mm_token_type_ids is given or derived
    pos2, _ = _ours(batch, attention_mask=mask, second_per_grid_ts=secs, mm_token_type_ids=batch["mm_token_type_ids"])
    assert torch.equal(pos, pos2)


def test_video_temporal_scaling_is_real(hf_model):
    """second_per_grid_ts changes the temporal row (guards against a test that cannot fail)."""
    g = torch.Generator().manual_seed(1)
    batch = F.batch_samples([F.build_sample([2, ("video", (3, 4, 4)), 2], g)])
    fast, _ = _ours(batch, second_per_grid_ts=torch.tensor([0.5]))
    slow, _ = _ours(batch, second_per_grid_ts=torch.tensor([2.0]))
    assert not torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
    ref, _ = _ref(hf_model, batch, second_per_grid_ts=torch.tensor([2.0]))
    assert torch.equal(slow, ref)


def test_packed_positions_restart_per_sample(hf_model):
    g = torch.Generator().manual_seed(2)
    samples = [F.build_sample(p, g) for p in CASES["batch"]]
    ids = torch.tensor([sum((s["input_ids"] for s in samples), [])])
    lengths = [len(s["input_ids"]) for s in samples]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    packed = {"input_ids": ids,
              "image_grid_thw": F._cat([s["image_grid_thw"] for s in samples]),
              "video_grid_thw": F._cat([s["video_grid_thw"] for s in samples])}
    pos, delta = _ours(packed, cu_seqlens=cu)
    for i, (s, lo, hi) in enumerate(zip(samples, cu[:-1].tolist(), cu[1:].tolist())):
        alone = F.batch_samples([s])
        ref, ref_delta = _ref(hf_model, alone)
        assert torch.equal(pos[:, :, lo:hi], ref), f"sample {i}"
        assert delta[i].item() == ref_delta[0].item()


def test_grid_and_placeholder_mismatch_is_reported():
    g = torch.Generator().manual_seed(3)
    batch = F.batch_samples([F.build_sample([2, ("image", (1, 4, 6)), 2], g)])
    batch["image_grid_thw"] = torch.tensor([[1, 4, 4]])
    with pytest.raises(ValueError, match=r"sample 0: a image run has 6 placeholder tokens but its grid \[1, 4, 4\] gives 4"):
        _ours(batch)
    batch["image_grid_thw"] = None
    with pytest.raises(ValueError, match="more image placeholder runs than entries in image_grid_thw"):
        _ours(batch)


GRIDS = [[[1, 8, 12]], [[1, 6, 10], [2, 4, 4]], [[3, 10, 6], [1, 2, 2], [1, 14, 8]]]


@pytest.mark.parametrize("grids", GRIDS)
@pytest.mark.parametrize("window_size", [56, 84, 112])
def test_vision_window_index_matches_transformers(grids, window_size):
    grid = torch.tensor(grids)
    ref_index, ref_cu = vision_utils.get_vision_window_index(grid, spatial_merge_size=2, window_size=window_size,
                                                             patch_size=14)
    index, cu = vision_window_index(grid, 2, window_size, 14)
    assert torch.equal(index, ref_index)
    assert torch.equal(cu, ref_cu)


@pytest.mark.parametrize("grids", GRIDS)
def test_vision_positions_and_cu_seqlens_match_transformers(grids):
    grid = torch.tensor(grids)
    assert torch.equal(vision_hw_position_ids(grid, 2), vision_utils.get_vision_position_ids(grid, 2))
    assert torch.equal(vision_cu_seqlens(grid), vision_utils.get_vision_cu_seqlens(grid))
