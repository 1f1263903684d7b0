"""M-RoPE position ids and vision index helpers against references nobody here wrote.

Images and text: transformers' own `Qwen2_5_VLModel.get_rope_index` (5.24), exactly. Videos: the original
Qwen2.5-VL rule (the Qwen team's code, transformers PR #35569 up to v5.2, and vLLM 0.32's), transcribed in pure
torch in tests/fixtures/original_mrope.py: text after a video resumes at the video's largest position + 1.
transformers 5.3+ resume it at start + max(h, w) / merge instead (a regression, huggingface/transformers#45381),
so there the positions equal ours up to the end of the first video whose temporal extent
int((t - 1) * tokens_per_second * second_per_grid_t) passes max(h, w) / merge - 1, and every position after it
differs (ours larger); that is asserted too, so a drift back to the 5.x rule fails here."""
import numpy as np
import pytest
import torch
from transformers import vision_utils

from megatron_vlm import _ext
from megatron_vlm.models.common.mrope_index import get_mrope_position_ids
from megatron_vlm.models.common.vision import vision_cu_seqlens, vision_hw_position_ids, vision_window_index
from tests.fixtures import tiny_qwen2_5_vl as F
from tests.fixtures.original_mrope import original_qwen2_5_vl_positions

TPS = 2


@pytest.fixture(scope="module")
def hf_model():
    return F.hf_reference_model(seed=0, text_layers=1, vision_depth=2)


def _ours(batch, **kw):
    return get_mrope_position_ids(
        batch["input_ids"], image_token_id=F.IMAGE_TOKEN_ID, video_token_id=F.VIDEO_TOKEN_ID,
        spatial_merge_size=F.MERGE, tokens_per_second=TPS, image_grid_thw=batch["image_grid_thw"],
        video_grid_thw=batch["video_grid_thw"], **kw,
    )


def _ref(hf_model, batch, **kw):
    return hf_model.model.get_rope_index(
        batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"], image_grid_thw=batch["image_grid_thw"],
        video_grid_thw=batch["video_grid_thw"], **kw,
    )


def _original(batch, time="float64", **kw):
    return original_qwen2_5_vl_positions(
        batch["input_ids"], image_token_id=F.IMAGE_TOKEN_ID, video_token_id=F.VIDEO_TOKEN_ID,
        spatial_merge_size=F.MERGE, tokens_per_second=TPS, image_grid_thw=batch["image_grid_thw"],
        video_grid_thw=batch["video_grid_thw"], time=time, **kw,
    )


IMAGE_CASES = {
    "image": [[3, ("image", (1, 4, 6)), 5]],
    "two_images": [[2, ("image", (1, 6, 4)), 3, ("image", (1, 4, 8)), 4]],
    "batch": [[3, ("image", (1, 4, 6)), 5], [7], [1, ("image", (1, 8, 4)), 2, ("image", (1, 4, 4)), 1]],
}
VIDEO_CASES = {
    "one_video": [[3, ("video", (3, 4, 6)), 5]],
    "video_and_images": [[2, ("image", (1, 6, 4)), 3, ("video", (3, 4, 6)), 2, ("image", (1, 4, 8)), 4]],
    "two_videos": [[2, ("video", (4, 4, 4)), 3, ("video", (2, 6, 4)), 2]],
    "vision_first_and_last": [[("image", (1, 4, 4)), 2, ("video", (2, 4, 4))]],
    "batch": [[3, ("image", (1, 4, 6)), 5], [7], [1, ("video", (4, 4, 4)), 2, ("image", (1, 8, 4)), 1]],
}
SECONDS = {"fractional": [0.5, 1.5], "integer": [1.0, 2.0], "none": None}


def _batch(parts, padding_side, seed=0):
    g = torch.Generator().manual_seed(seed)
    return F.batch_samples([F.build_sample(p, g) for p in parts], padding_side=padding_side)


@pytest.mark.parametrize("name", sorted(IMAGE_CASES))
@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_images_match_get_rope_index(hf_model, name, padding_side):
    batch = _batch(IMAGE_CASES[name], padding_side)
    mask = batch["attention_mask"]
    ref_pos, ref_delta = _ref(hf_model, batch, attention_mask=mask)
    pos, delta = _ours(batch, attention_mask=mask)
    assert torch.equal(pos[:, mask.bool()], ref_pos[:, mask.bool()])
    assert torch.equal(delta, ref_delta)
    # our result is the same whether mm_token_type_ids is given or derived
    pos2, _ = _ours(batch, attention_mask=mask, mm_token_type_ids=batch["mm_token_type_ids"])
    assert torch.equal(pos, pos2)


def _first_long_video_end(tokens, grids, secs):
    """Index just after the first video run of `tokens` whose temporal extent passes max(h, w) / merge - 1 (where
    transformers 5.3+ and the original rule part), or None; consumes that row's grids / seconds."""
    end, i = None, 0
    while i < len(tokens):
        if tokens[i] != F.VIDEO_TOKEN_ID:
            i += 1
            continue
        t, h, w = next(grids)
        sec = next(secs) if secs is not None else 1.0
        n = t * (h // F.MERGE) * (w // F.MERGE)
        extent = int((t - 1) * float(np.float32(sec)) * TPS)
        if end is None and extent > max(h, w) // F.MERGE - 1:
            end = i + n
        i += n
    return end


@pytest.mark.parametrize("name,padding_side", [(n, "left") for n in sorted(VIDEO_CASES)] + [("batch", "right")])
@pytest.mark.parametrize("seconds", sorted(SECONDS))
def test_videos_follow_the_original_rule(hf_model, name, seconds, padding_side):
    """Ours = the original rule's transcription; transformers 5.24 equal up to the first long video, then lower."""
    batch = _batch(VIDEO_CASES[name], padding_side)
    n_videos = len(batch["video_grid_thw"])
    secs = torch.tensor(SECONDS[seconds][:n_videos]) if SECONDS[seconds] else None
    mask = batch["attention_mask"]
    want, want_delta = _original(batch, attention_mask=mask, second_per_grid_ts=secs)
    pos, delta = _ours(batch, attention_mask=mask, second_per_grid_ts=secs)
    assert torch.equal(pos, want) and torch.equal(delta, want_delta)
    pos2, _ = _ours(batch, attention_mask=mask, second_per_grid_ts=secs, mm_token_type_ids=batch["mm_token_type_ids"])
    assert torch.equal(pos, pos2)
    with _ext.python_only():  # the Python rule too, where the compiled twin answered above
        assert torch.equal(_ours(batch, attention_mask=mask, second_per_grid_ts=secs)[0], pos)

    hf_pos, hf_delta = _ref(hf_model, batch, attention_mask=mask, second_per_grid_ts=secs)
    # the transcription's 5.3+ variant is transformers' own rule (it measures that rule's gap in the vLLM tests)
    five, five_delta = _original(batch, attention_mask=mask, second_per_grid_ts=secs, resume="transformers5")
    assert torch.equal(five, hf_pos) and torch.equal(five_delta, hf_delta)
    grids = iter(batch["video_grid_thw"].tolist())
    sec_iter = iter(secs.tolist()) if secs is not None else None
    parted = 0
    for b in range(mask.shape[0]):
        keep = mask[b].bool()
        ours_b, hf_b = pos[:, b, keep], hf_pos[:, b, keep]
        end = _first_long_video_end(batch["input_ids"][b, keep].tolist(), grids, sec_iter)
        if end is None:
            assert torch.equal(ours_b, hf_b), f"row {b}"
            continue
        assert torch.equal(ours_b[:, :end], hf_b[:, :end]), f"row {b}"
        assert (ours_b[:, end:] > hf_b[:, end:]).all(), f"row {b}: every position after the video is shifted"
        parted += end < ours_b.shape[1]
    if seconds != "fractional" and name != "vision_first_and_last":
        assert parted  # these cases hold a long video followed by tokens: the two rules must part


def test_video_temporal_scaling_is_real(hf_model):
    """second_per_grid_ts changes the temporal row (guards against a test that cannot fail)."""
    batch = _batch([[2, ("video", (3, 4, 4)), 2]], "right", seed=1)
    fast, _ = _ours(batch, second_per_grid_ts=torch.tensor([0.5]))
    slow, _ = _ours(batch, second_per_grid_ts=torch.tensor([2.0]))
    n = 2 + 1 + 3 * 2 * 2  # text, vision start, the video
    assert not torch.equal(fast[0], slow[0]) and torch.equal(fast[1:, :, :n], slow[1:, :, :n])
    assert (slow[:, 0, n:] > fast[:, 0, n:]).all()  # the text after the video resumes after its last frame
    assert torch.equal(slow, _original(batch, second_per_grid_ts=torch.tensor([2.0]))[0])
    ref, _ = _ref(hf_model, batch, second_per_grid_ts=torch.tensor([2.0]))
    assert torch.equal(slow[:, :, :n], ref[:, :, :n]) and not torch.equal(slow, ref)


@pytest.mark.parametrize("python", [False, True], ids=["compiled", "python"])
def test_temporal_quantisation_is_vllms(python):
    """The temporal index is int(i * tokens_per_second * second_per_grid_t) after the multiplication, in float64 as
    vLLM 0.32 (tests/unit/rl/test_vllm_engine.py compares with vLLM's own function): 0.5 s at 2 tokens per second
    steps 0, 1, 2, 3 (never truncated to 0 first, transformers#48669); fps 0.3 with temporal patch 2 (6.666... s
    per grid) gives 39 at the fourth grid, where the original's float32 product gives 40 (a rounding artefact;
    both references are computed and must differ, so the case is a real one)."""
    import contextlib

    batch = _batch([[2, ("video", (4, 2, 2)), 2]], "right")
    for sec, steps in ((0.5, [0, 1, 2, 3]), (2 / 0.3, [0, 13, 26, 39])):
        secs = torch.tensor([sec], dtype=torch.float32)
        with _ext.python_only() if python else contextlib.nullcontext():
            pos, _ = _ours(batch, second_per_grid_ts=secs)
        video = pos[0, 0, 3:7] - 3  # the four grids (one merged token each) after 2 text tokens + vision start
        assert video.tolist() == steps
        assert torch.equal(pos, _original(batch, second_per_grid_ts=secs)[0])
        assert pos[0, 0, 7] == 3 + steps[-1] + 1  # vision end: after the video's last temporal position
    float32 = _original(batch, time="float32", second_per_grid_ts=torch.tensor([2 / 0.3]))[0]
    assert float32[0, 0, 3:7].tolist() == [3, 16, 29, 43]


def test_packed_positions_restart_per_sample(hf_model):
    samples_parts = VIDEO_CASES["batch"]
    g = torch.Generator().manual_seed(2)
    samples = [F.build_sample(p, g) for p in samples_parts]
    ids = torch.tensor([sum((s["input_ids"] for s in samples), [])])
    lengths = [len(s["input_ids"]) for s in samples]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    packed = {"input_ids": ids,
              "image_grid_thw": F._cat([s["image_grid_thw"] for s in samples]),
              "video_grid_thw": F._cat([s["video_grid_thw"] for s in samples])}
    pos, delta = _ours(packed, cu_seqlens=cu)
    for i, (s, lo, hi) in enumerate(zip(samples, cu[:-1].tolist(), cu[1:].tolist())):
        alone = F.batch_samples([s])
        ref, ref_delta = _original(alone)
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
