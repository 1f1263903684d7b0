"""merge_vision_embeddings: scatter order against a plain loop, and the mismatch errors."""
import pytest
import torch

from megatron_vlm.models.common.merge import merge_vision_embeddings

IMG = 9


def _loop_reference(embeds, ids, feats):
    out = embeds.clone()
    n = 0
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            if ids[b, t] == IMG:
                out[b, t] = feats[n]
                n += 1
    return out


def test_scatter_in_order():
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([[1, IMG, IMG, 2, IMG, 0], [IMG, 3, 4, IMG, IMG, IMG]])
    embeds = torch.randn(2, 6, 8, generator=g)
    feats = torch.randn(7, 8, generator=g)
    out = merge_vision_embeddings(embeds, ids, feats, IMG)
    assert torch.equal(out, _loop_reference(embeds, ids, feats))


def test_no_placeholders_returns_input():
    embeds = torch.randn(1, 3, 4)
    ids = torch.tensor([[1, 2, 3]])
    assert merge_vision_embeddings(embeds, ids, torch.zeros(0, 4), IMG) is embeds


def test_mismatch_names_both_numbers():
    ids = torch.tensor([[1, IMG, IMG, IMG, 2]])
    with pytest.raises(ValueError, match=r"3 placeholder tokens .* but 4 image features \(sample 0\)"):
        merge_vision_embeddings(torch.zeros(1, 5, 4), ids, torch.zeros(4, 4), IMG)


def test_mismatch_names_the_sample():
    # sample 0 has 2 placeholders (one image of 2 tokens); sample 1 was truncated to 3 of its 4
    ids = torch.tensor([[IMG, IMG, 1, 1, 0], [1, IMG, IMG, IMG, 1]])
    with pytest.raises(ValueError, match=r"5 placeholder tokens .* but 6 video features; first mismatch at sample 1: "
                                         r"3 placeholder tokens there but its videos give 4 features"):
        merge_vision_embeddings(torch.zeros(2, 5, 4), ids, torch.zeros(6, 4), IMG, modality="video",
                                features_per_item=[2, 4])


def test_mismatch_in_packed_input_names_the_sample():
    ids = torch.tensor([[1, IMG, 1, IMG, IMG, 1, IMG]])
    cu = torch.tensor([0, 3, 6, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"first mismatch at sample 2: 1 placeholder tokens there but its images give 4"):
        merge_vision_embeddings(torch.zeros(1, 7, 4), ids, torch.zeros(7, 4), IMG, features_per_item=[1, 2, 4],
                                cu_seqlens=cu)


def test_model_forward_reports_truncated_image():
    from megatron_vlm.models import build_model
    from tests.fixtures import tiny_qwen2_5_vl as F

    torch.manual_seed(0)
    model = build_model(F.tiny_qwen2_5_vl_config_dict(text_layers=1, vision_depth=2))
    g = torch.Generator().manual_seed(1)
    s = F.build_sample([2, ("image", (1, 4, 4)), 2], g)
    ids = torch.tensor([s["input_ids"][:-4]])  # cut one placeholder (and the text after it)
    with pytest.raises(ValueError, match=r"3 placeholder tokens .* but 4 image features; first mismatch at sample 0"):
        model(ids, pixel_values=s["pixel_values"], image_grid_thw=s["image_grid_thw"])
