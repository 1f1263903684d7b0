"""Packing invariants: first-fit placement, shifted labels that never cross a sample boundary,
cu_seqlens, vision tensors in sample order, padded collate for evaluation."""
from __future__ import annotations

import random

import pytest
import torch

from megatron_vlm.data.batch import IGNORE_INDEX
from megatron_vlm.data.packing import collate_pack, collate_padded, empty_pack, first_fit_pack
from megatron_vlm.data.processing import ProcessedSample


def _sample(n, *, first_label=None, image_rows=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (n,), generator=g)
    mask = torch.zeros(n, dtype=torch.bool)
    if first_label is not None:
        mask[first_label:] = True
    s = ProcessedSample(input_ids=ids, label_mask=mask)
    if image_rows:
        s.pixel_values = torch.randn(image_rows, 8, generator=g)
        s.image_grid_thw = torch.tensor([[1, 2, image_rows // 2]])
    return s


def test_first_fit_places_each_sample_once_within_capacity():
    rng = random.Random(0)
    lengths = [rng.randint(1, 50) for _ in range(300)]
    order = list(range(300))
    rng.shuffle(order)
    packs = first_fit_pack(lengths, order, capacity=64)
    flat = [i for p in packs for i in p]
    assert sorted(flat) == list(range(300))
    assert all(sum(lengths[i] for i in p) <= 64 for p in packs)
    efficiency = sum(lengths) / (len(packs) * 64)
    assert efficiency > 0.9


def test_first_fit_is_first_fit():
    # capacity 10: 6 -> pack0, 6 -> pack1, 4 -> pack0 (first with room), 3 -> pack1, 1 -> pack1
    assert first_fit_pack([6, 6, 4, 3, 1], [0, 1, 2, 3, 4], 10) == [[0, 2], [1, 3, 4]]
    # the visiting order decides
    assert first_fit_pack([6, 6, 4, 3, 1], [4, 3, 2, 1, 0], 10) == [[4, 3, 2], [1], [0]]


def test_first_fit_bounds_open_packs_and_rejects_oversize():
    packs = first_fit_pack([9, 9, 9, 1], [0, 1, 2, 3], 10, max_open=1)
    assert packs == [[0], [1], [2, 3]]  # packs 0 and 1 were closed before the 1 arrived
    with pytest.raises(ValueError, match="sample 1 has 11 tokens"):
        first_fit_pack([5, 11], [0, 1], 10)


def test_collate_pack_labels_shifted_and_never_cross_samples():
    a = _sample(5, first_label=3, seed=1)   # tokens 3, 4 are trained
    b = _sample(4, first_label=1, seed=2)   # tokens 1, 2, 3 are trained
    pack = collate_pack([a, b])
    ids, labels = pack["input_ids"][0], pack["labels"][0]
    assert pack["input_ids"].shape == pack["labels"].shape == (1, 9)
    assert pack["cu_seqlens"].dtype == torch.int32 and pack["cu_seqlens"].tolist() == [0, 5, 9]
    expected = [IGNORE_INDEX, IGNORE_INDEX, ids[3], ids[4], IGNORE_INDEX,   # last of sample a: -100
                ids[6], ids[7], ids[8], IGNORE_INDEX]                        # last of sample b: -100
    assert labels.tolist() == [int(x) for x in expected]
    assert int(pack["num_label_tokens"]) == 5 and int(pack["num_samples"]) == 2
    # labels at the last position of each sample are ignored: no prediction across a boundary
    cu = pack["cu_seqlens"].tolist()
    assert all(labels[e - 1] == IGNORE_INDEX for e in cu[1:])


def test_collate_pack_concatenates_vision_in_sample_order():
    a, b, c = _sample(6, image_rows=4, seed=3), _sample(3, seed=4), _sample(7, image_rows=6, seed=5)
    pack = collate_pack([a, b, c])
    assert torch.equal(pack["pixel_values"], torch.cat([a.pixel_values, c.pixel_values]))
    assert pack["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 3]]
    assert "pixel_values_videos" not in pack


def test_empty_pack_trains_nothing():
    p = empty_pack(7)
    assert p["input_ids"].tolist() == [[7]] and p["labels"].tolist() == [[IGNORE_INDEX]]
    assert p["cu_seqlens"].tolist() == [0, 1] and int(p["num_label_tokens"]) == 0 and int(p["num_samples"]) == 0


@pytest.mark.parametrize("side", ["right", "left"])
def test_collate_padded(side):
    a, b = _sample(5, first_label=2, seed=6), _sample(3, first_label=1, seed=7)
    a.input_ids[1] = 90  # an "image" token
    batch = collate_padded([a, b], pad_token_id=0, padding_side=side, image_token_id=90, video_token_id=91)
    assert batch["input_ids"].shape == (2, 5)
    row = batch["input_ids"][1]
    if side == "right":
        assert row[:3].tolist() == b.input_ids.tolist() and row[3:].tolist() == [0, 0]
        assert batch["attention_mask"][1].tolist() == [1, 1, 1, 0, 0]
        assert batch["labels"][1].tolist() == [int(b.input_ids[1]), int(b.input_ids[2]), -100, -100, -100]
    else:
        assert row[2:].tolist() == b.input_ids.tolist() and row[:2].tolist() == [0, 0]
        assert batch["attention_mask"][1].tolist() == [0, 0, 1, 1, 1]
        assert batch["labels"][1].tolist() == [-100, -100, int(b.input_ids[1]), int(b.input_ids[2]), -100]
    assert batch["mm_token_type_ids"][0].tolist() == [0, 1, 0, 0, 0]
