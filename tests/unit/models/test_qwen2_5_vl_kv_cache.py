"""KV-cache decoding of Qwen2.5-VL: cached logits equal full-forward logits, greedy decoding with the
cache equals argmax decoding without it and transformers' generate(), left-padded prompts, and one
prefill shared by a group of G samples."""
import pytest
import torch

from megatron_vlm.models import build_model
from megatron_vlm.models.qwen2_5_vl.state_dict_adapter import Qwen2_5_VLStateDictAdapter
from tests.fixtures import tiny_qwen2_5_vl as F

TOL = 1e-4


@pytest.fixture(scope="module")
def models():
    hf = F.hf_reference_model(seed=0)
    ours = build_model(F.tiny_qwen2_5_vl_config_dict())
    ours.load_state_dict(Qwen2_5_VLStateDictAdapter(ours.args).from_hf(hf.state_dict())[0], strict=True)
    return hf, ours.eval()


def _vision(batch):
    return {k: batch[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}


@torch.no_grad()
def _greedy_cached(model, batch, steps, max_len=None):
    ids, mask = batch["input_ids"], batch["attention_mask"]
    cache = model.new_cache(ids.shape[0], max_len or ids.shape[1] + steps)
    logits = model(ids, mask, **_vision(batch), kv_cache=cache)
    out, step_logits = [], []
    nxt = logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(steps):
        out.append(nxt)
        logits = model(nxt, kv_cache=cache)
        step_logits.append(logits[:, -1])
        nxt = logits[:, -1].argmax(-1, keepdim=True)
    return torch.cat(out, dim=1), step_logits


@torch.no_grad()
def _greedy_full(model, batch, steps):
    ids, mask = batch["input_ids"], batch["attention_mask"]
    out = []
    for _ in range(steps):
        logits = model(ids, mask, **_vision(batch))
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
        ids = torch.cat([ids, nxt], dim=1)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
    return torch.cat(out, dim=1)


def test_cached_logits_equal_full_forward(models):
    hf, ours = models
    g = torch.Generator().manual_seed(1)
    sample = F.build_sample([3, ("image", (1, 4, 6)), 2, ("video", (3, 4, 4)), 4], g)
    prompt = F.batch_samples([sample])
    cont = torch.tensor([F.text_tokens(5, g)])
    full = dict(prompt, input_ids=torch.cat([prompt["input_ids"], cont], 1))
    full["attention_mask"] = torch.ones_like(full["input_ids"])
    full["mm_token_type_ids"] = F.mm_token_type_ids(full["input_ids"])
    full["second_per_grid_ts"] = prompt["second_per_grid_ts"] = torch.tensor([1.5])
    with torch.no_grad():
        # the reference on the original rule's positions: transformers 5.3+ resume the text after the video elsewhere
        # (test_qwen2_5_vl_parity.py::test_video_with_second_per_grid_ts)
        ref = hf(**full, position_ids=F.original_position_ids(full)).logits
        cache = ours.new_cache(1, full["input_ids"].shape[1] + 3)
        n = prompt["input_ids"].shape[1]
        pieces = [ours(prompt["input_ids"], **_vision(prompt), second_per_grid_ts=prompt["second_per_grid_ts"],
                       kv_cache=cache)]
        pieces.append(ours(cont[:, :2], kv_cache=cache))  # a 2-token chunk, then single tokens
        for i in range(2, 5):
            pieces.append(ours(cont[:, i:i + 1], kv_cache=cache))
    cached = torch.cat(pieces, dim=1)
    assert cache.seq_len == n + 5
    assert (cached - ref).abs().max().item() <= TOL


def test_greedy_with_cache_equals_without_and_transformers_generate(models):
    hf, ours = models
    g = torch.Generator().manual_seed(2)
    batch = F.batch_samples([F.build_sample([4, ("image", (1, 8, 4)), 6], g)])
    steps = 8
    cached, _ = _greedy_cached(ours, batch, steps)
    assert torch.equal(cached, _greedy_full(ours, batch, steps))
    with torch.no_grad():
        ref = hf.generate(**{k: v for k, v in batch.items() if v is not None}, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    assert torch.equal(cached, ref[:, batch["input_ids"].shape[1]:])


def test_left_padded_prompts(models):
    hf, ours = models
    g = torch.Generator().manual_seed(3)
    samples = [F.build_sample([2, ("image", (1, 4, 6)), 3], g), F.build_sample([9], g),
               F.build_sample([1, ("image", (1, 4, 4)), 1, ("image", (1, 6, 4)), 2], g)]
    batch = F.batch_samples(samples, padding_side="left")
    steps = 6
    cached, step_logits = _greedy_cached(ours, batch, steps)
    # every row decodes as if it were alone (no padding at all)
    for i, s in enumerate(samples):
        alone = F.batch_samples([s])
        assert torch.equal(cached[i:i + 1], _greedy_full(ours, alone, steps)), f"row {i}"
        with torch.no_grad():
            ids = torch.cat([alone["input_ids"], cached[i:i + 1]], dim=1)
            full = ours(ids, **_vision(alone))[0, -steps - 1:-1]
        err = (torch.stack([lg[i] for lg in step_logits])[:-1] - full[1:]).abs().max().item()
        assert err <= TOL, f"row {i}: cached step logits differ by {err}"
    with torch.no_grad():
        ref = hf.generate(**{k: v for k, v in batch.items() if v is not None}, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    assert torch.equal(cached, ref[:, batch["input_ids"].shape[1]:])


def test_one_prefill_serves_a_group(models):
    _, ours = models
    g = torch.Generator().manual_seed(4)
    prompt = F.batch_samples([F.build_sample([3, ("image", (1, 4, 6)), 4], g)])
    group = 3
    with torch.no_grad():
        cache = ours.new_cache(1, prompt["input_ids"].shape[1] + 4)
        ours(prompt["input_ids"], **_vision(prompt), kv_cache=cache)
        shared = cache.expand(group)
        answers = torch.tensor([F.text_tokens(4, g) for _ in range(group)])
        cached = torch.cat([ours(answers[:, i:i + 1], kv_cache=shared) for i in range(4)], dim=1)
        for j in range(group):
            ids = torch.cat([prompt["input_ids"], answers[j:j + 1]], dim=1)
            full = ours(ids, **_vision(prompt))[:, -4:]
            assert (cached[j:j + 1] - full).abs().max().item() <= TOL, f"group member {j}"
    assert shared.batch == group and cache.batch == 1


def test_cache_errors():
    from megatron_vlm.models.common.kv_cache import KVCache

    cache = KVCache(1, 1, 4, 1, 8)
    with pytest.raises(ValueError, match="exceed max_len 4"):
        cache.begin_step(5)
    with pytest.raises(ValueError, match=r"mask of the new tokens must be \[1, 2\]"):
        cache.begin_step(2, torch.ones(1, 3, dtype=torch.bool))
