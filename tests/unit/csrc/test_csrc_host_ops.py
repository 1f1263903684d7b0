"""C++ host ops (first-fit packing, M-RoPE position ids) equal their Python implementations exactly."""
import numpy as np
import pytest
import torch

from megatron_vlm.data.packing import first_fit_pack
from megatron_vlm.data.plan import PackPlanner
from megatron_vlm.models.common.mrope_index import get_mrope_position_ids

IMAGE, VIDEO, VSTART, VEND = 151655, 151656, 151652, 151653


def _python(fn, *args, **kwargs):
    from megatron_vlm import _ext

    with _ext.python_only():
        return fn(*args, **kwargs)


# ----- packing -----

@pytest.mark.parametrize("seed", range(4))
def test_first_fit_pack_random(ext, seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3000))
    capacity = int(rng.choice([64, 1000, 8192]))
    lengths = rng.integers(1, capacity + 1, size=n)
    order = rng.permutation(n)
    for max_open in (0, 1, 3, 64, 10_000):
        got = first_fit_pack(lengths, order, capacity, max_open)
        assert got == _python(first_fit_pack, lengths, order, capacity, max_open)
        assert got == ext.first_fit_pack(lengths, order, capacity, max_open)
    # lists of Python ints, a subset order, exact fits (rooms reaching 0)
    lengths = [int(x) for x in rng.integers(1, 5, size=200)]
    order = [int(i) for i in rng.permutation(200)[:150]]
    assert first_fit_pack(lengths, order, 8, 4) == _python(first_fit_pack, lengths, order, 8, 4)


def test_first_fit_pack_planner_shaped(ext):
    """What the loader plans: a shuffled epoch of a real-shaped length distribution (many short SFT
    samples, some long multi-image ones, a few bad records filtered by the planner)."""
    rng = np.random.default_rng(7)
    lengths = np.concatenate([rng.integers(80, 900, 5000), rng.integers(2000, 16_000, 600), [0, 40_000]])
    planner = PackPlanner(lengths, 16_384, seed=3, shuffle=True)
    for epoch in (0, 1):
        order = planner.order(epoch)
        got = planner.plan(epoch)
        assert ext.first_fit_pack(planner.lengths, order, 16_384, 64) == got
        assert got == _python(first_fit_pack, planner.lengths, order, 16_384, 64)
        assert sorted(i for p in got for i in p) == sorted(order.tolist())


@pytest.mark.parametrize("bad", [
    dict(lengths=[3, 9], order=[0, 1], capacity=8),     # longer than the capacity
    dict(lengths=[3, 0], order=[0, 1], capacity=8),     # empty sample
    dict(lengths=[3, 2], order=[0, 1], capacity=0),     # capacity
])
def test_first_fit_pack_errors_are_the_python_ones(ext, bad):
    with pytest.raises(ValueError) as compiled:
        first_fit_pack(**bad)
    with pytest.raises(ValueError) as python:
        _python(first_fit_pack, **bad)
    assert str(compiled.value) == str(python.value)


def test_first_fit_pack_negative_index_wraps_like_python(ext):
    assert first_fit_pack([2, 3, 4], [-1, 0], 8) == _python(first_fit_pack, [2, 3, 4], [-1, 0], 8)


# ----- M-RoPE position ids -----

def _sample(rng, *, videos: bool, qwen3: bool, merge: int = 2):
    """token ids of one multimodal sample and its image / video grids (Qwen-VL chat layout)."""
    ids, images, vids = [], [], []
    for _ in range(int(rng.integers(1, 6))):
        ids += rng.integers(0, 1000, int(rng.integers(1, 40))).tolist()
        kind = rng.integers(0, 3 if videos else 2)
        if kind == 0:
            continue
        h, w = int(rng.integers(1, 6)) * merge, int(rng.integers(1, 6)) * merge
        if kind == 1:
            images.append([1, h, w])
            ids += [VSTART] + [IMAGE] * (h * w // merge**2) + [VEND]
        else:
            t = int(rng.integers(1, 5))
            vids.append([t, h, w])
            if qwen3:  # "<t seconds>" text before every frame, each frame its own run
                for _f in range(t):
                    ids += rng.integers(0, 1000, 3).tolist() + [VSTART] + [VIDEO] * (h * w // merge**2) + [VEND]
            else:
                ids += [VSTART] + [VIDEO] * (t * h * w // merge**2) + [VEND]
    return ids, images, vids


def _batch(rng, n, *, videos, qwen3):
    samples = [_sample(rng, videos=videos, qwen3=qwen3) for _ in range(n)]
    grid = lambda rows: torch.tensor(rows, dtype=torch.long).reshape(-1, 3) if rows else None  # noqa: E731
    return samples, grid([g for s in samples for g in s[1]]), grid([g for s in samples for g in s[2]])


def _both(**kw):
    from megatron_vlm import _ext

    assert _ext.mrope_position_ids(**kw) is not None  # the compiled op ran (no silent fallback)
    got = get_mrope_position_ids(**kw)
    want = _python(get_mrope_position_ids, **kw)
    assert got[0].dtype == want[0].dtype == torch.long
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    return got


@pytest.mark.parametrize("seed", range(5))
def test_mrope_packed_qwen2_5_vl(ext, seed):
    """Packed multi-image / video samples with second_per_grid_ts (fractional intervals)."""
    rng = np.random.default_rng(seed)
    samples, img, vid = _batch(rng, 6, videos=True, qwen3=False)
    ids = torch.tensor([t for s in samples for t in s[0]]).unsqueeze(0)
    cu = torch.tensor(np.cumsum([0] + [len(s[0]) for s in samples]), dtype=torch.int32)
    # 2 / 0.3: a float32 / float64 truncation boundary at the fourth grid (test_qwen2_5_vl_positions.py)
    sec = None if vid is None else torch.tensor(rng.choice([0.5, 1.0, 2.0, 1 / 3, 0.7, 1.37, 2 / 0.3], len(vid)),
                                                dtype=torch.float32)
    _both(input_ids=ids, image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=2, tokens_per_second=2.0,
          image_grid_thw=img, video_grid_thw=vid, second_per_grid_ts=sec, cu_seqlens=cu)
    # without second_per_grid_ts (tokens_per_second per grid), and with a list of seconds
    _both(input_ids=ids, image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=2, tokens_per_second=25.0,
          image_grid_thw=img, video_grid_thw=vid, cu_seqlens=cu)
    if vid is not None:
        _both(input_ids=ids, image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=2, tokens_per_second=0.3,
              image_grid_thw=img, video_grid_thw=vid, second_per_grid_ts=sec.tolist(), cu_seqlens=cu)


@pytest.mark.parametrize("side", ["left", "right"])
def test_mrope_padded_batch(ext, side):
    rng = np.random.default_rng(11)
    samples, img, vid = _batch(rng, 4, videos=True, qwen3=False)
    t_max = max(len(s[0]) for s in samples)
    ids = torch.zeros(len(samples), t_max, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, (tokens, _, _) in enumerate(samples):
        sl = slice(0, len(tokens)) if side == "right" else slice(t_max - len(tokens), t_max)
        ids[r, sl] = torch.tensor(tokens)
        mask[r, sl] = 1
    sec = None if vid is None else torch.full((len(vid),), 0.5)
    _both(input_ids=ids, attention_mask=mask, image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=2,
          tokens_per_second=2.0, image_grid_thw=img, video_grid_thw=vid, second_per_grid_ts=sec)
    # explicit mm_token_type_ids, no mask; text only
    types = torch.zeros_like(ids)
    types[ids == IMAGE], types[ids == VIDEO] = 1, 2
    _both(input_ids=ids[:1, :5], mm_token_type_ids=types[:1, :5] * 0, image_token_id=IMAGE, video_token_id=VIDEO,
          spatial_merge_size=2, tokens_per_second=2.0)


@pytest.mark.parametrize("seed", range(3))
def test_mrope_qwen3_vl_rule(ext, seed):
    """Qwen3-VL: timestamps are text, each video frame is its own run with a [1, h, w] grid."""
    from megatron_vlm.models.qwen3_vl.model import split_video_grids

    rng = np.random.default_rng(100 + seed)
    samples, img, vid = _batch(rng, 5, videos=True, qwen3=True)
    ids = torch.tensor([t for s in samples for t in s[0]]).unsqueeze(0)
    cu = torch.tensor(np.cumsum([0] + [len(s[0]) for s in samples]), dtype=torch.int32)
    pos, _ = _both(input_ids=ids, image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=2,
                   tokens_per_second=1.0, image_grid_thw=img, video_grid_thw=split_video_grids(vid), cu_seqlens=cu)
    assert pos.shape == (3, 1, ids.shape[1])


@pytest.mark.parametrize("case", ["too_few_grids", "grid_mismatch", "bad_type", "bad_cu"])
def test_mrope_errors_are_the_python_ones(ext, case):
    ids = torch.tensor([[1, 2, IMAGE, IMAGE, IMAGE, IMAGE, 5]])
    kw = dict(input_ids=ids, image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=2, tokens_per_second=2.0,
              image_grid_thw=torch.tensor([[1, 4, 4]]))
    if case == "too_few_grids":
        kw["image_grid_thw"] = None
    elif case == "grid_mismatch":
        kw["image_grid_thw"] = torch.tensor([[1, 4, 6]])
    elif case == "bad_type":
        kw["mm_token_type_ids"] = torch.full_like(ids, 3)
    else:
        kw["cu_seqlens"] = torch.tensor([0, 5, 3, 7])
    with pytest.raises(ValueError) as compiled:
        get_mrope_position_ids(**kw)
    with pytest.raises(ValueError) as python:
        _python(get_mrope_position_ids, **kw)
    assert str(compiled.value) == str(python.value)


def test_mrope_op_meta_kernel(ext):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        ids = torch.empty(1, 50, dtype=torch.long)
        pos, deltas = torch.ops.megatron_vlm.mrope_position_ids(
            ids, None, None, torch.empty(4, dtype=torch.int32), None, None, None, 2.0, IMAGE, VIDEO, 2)
    assert pos.shape == (3, 1, 50) and deltas.shape == (3, 1)


def test_mrope_op_names_the_bad_token_type(ext):
    """The compiled op's own message (not the Python fallback's) for an unknown mm_token_type_ids value: the
    one error path of the host ops that puts a number into its message (built without iostreams, csrc/check.h)."""
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"mm_token_type_ids has value 3; expected 0, 1 or 2"):
        torch.ops.megatron_vlm.mrope_position_ids(ids, torch.full_like(ids, 3), None, None, None, None, None,
                                                   1.0, IMAGE, VIDEO, 2)
