"""The training forward of every family (`TokenLogprobModel` over a packed batch with images, as SFT, LoRA, DPO and
GRPO run it) reads no device value, given the batch as `RunContext.to_device` makes it: device copies that keep
the loader's host tensors (megatron_vlm/host_copies.py), a pack whose prompt is shared by two answers included
(`prefix_segments`). Its log-probs and gradients are those of the same
forward over the host tensors themselves (the code path of a batch without host copies: the model reads the
tensors it was given).

On CUDA each read of a device value is a stream sync; before, the forward read the grids (vision bookkeeping at its
start, the merge's counts after the vision tower), the longest sequence of `cu_seqlens` (every attention), the M-RoPE
positions' inputs, and the count of the labels' bool mask after the decoder. Counted on the CPU with `HostReads`;
the CPU reference kernel of the token log-probs (kernels/reference/, never run on a GPU) is left out.
"""
from __future__ import annotations

import pytest
import torch

from megatron_vlm.data.batch import shifted_labels
from megatron_vlm.host_copies import moved_to
from megatron_vlm.models import build_model
from megatron_vlm.testing.host_reads import HostReads
from megatron_vlm.testing.tiny_model import tiny_qwen2_5_vl_hf_config
from megatron_vlm.testing.tiny_nemotron_vl import (
    build_tiny_nemotron_vl_tokenizer,
    tiny_nemotron_qwen3_vision_hf_config,
    tiny_nemotron_vl_hf_config,
)
from megatron_vlm.testing.tiny_processor_internvl import TILE, tiny_internvl_config_dict
from megatron_vlm.testing.tiny_processor_qwen3_vl import tiny_qwen3_vl_config_dict
from megatron_vlm.testing.tiny_text_model import tiny_qwen_text_hf_config
from megatron_vlm.training.lm_loss import TokenLogprobModel

_IDS = {"vocab_size": 128, "eos_token_id": 1, "pad_token_id": 0, "bos_token_id": None, "image_token_id": 120,
        "video_token_id": 121, "vision_start_token_id": 122, "vision_end_token_id": 123}

# family -> (config, the vision input kind: "thw" (patches + image_grid_thw), "hw" (RADIO: patches of one frame,
# image_grid_thw with t = 1, as the data pipeline gives them), "tiles" (InternVL), None (text))
FAMILIES = {
    "qwen2_5_vl": (lambda: tiny_qwen2_5_vl_hf_config(_IDS), "thw"),
    "qwen3_vl": (tiny_qwen3_vl_config_dict, "thw"),
    "qwen3_vl_moe": (lambda: tiny_qwen3_vl_config_dict(moe=True), "thw"),
    "internvl": (tiny_internvl_config_dict, "tiles"),
    "nemotron_vl_radio": (lambda: tiny_nemotron_vl_hf_config(build_tiny_nemotron_vl_tokenizer()), "hw"),
    "nemotron_vl_qwen3_vision": (lambda: tiny_nemotron_qwen3_vision_hf_config(_IDS), "thw"),
    "qwen3": (lambda: tiny_qwen_text_hf_config("qwen3", vocab_size=128), None),
}


def _tower(model):
    return getattr(model, "visual", None) or model.vision_model


def _pack(model, kind, g: torch.Generator) -> dict:
    """Three samples (text, an image or none, text), the answers' text trained."""
    args = model.args
    samples, train, vision = [], [], {"pixel_values": [], "grid": []}
    for i, image in enumerate([(1, 4, 6), None, (1, 4, 4)] if kind else [None] * 3):
        ids = torch.randint(2, 60, (5 + i,), generator=g).tolist()
        if image is not None:
            t, h, w = image
            if kind == "thw":
                n = t * h * w // args.vision.spatial_merge_size**2
                vision["pixel_values"].append(torch.randn(t * h * w, _tower(model).patch_embed.patch_dim, generator=g))
                vision["grid"].append([t, h, w])
            elif kind == "hw":
                n = h * w // args.merge_size**2
                patch = args.vision.patch_size
                vision["pixel_values"].append(torch.randn(h * w, 3 * patch * patch, generator=g))
                vision["grid"].append([1, h, w])
            else:
                n = args.tokens_per_tile
                vision["pixel_values"].append(torch.randn(1, 3, TILE, TILE, generator=g))
            ids += [args.image_token_id] * n
        answer = torch.randint(2, 60, (4,), generator=g).tolist()
        samples.append(ids + answer)
        train.append([False] * len(ids) + [True] * len(answer))
    lengths = [len(s) for s in samples]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.tensor(sum(samples, []))
    pack = {"input_ids": ids[None], "cu_seqlens": cu,
            "labels": shifted_labels(ids, torch.tensor(sum(train, [])), cu)[None]}
    if kind is not None:
        pack["pixel_values"] = torch.cat(vision["pixel_values"])
    if kind in ("thw", "hw"):
        pack["image_grid_thw"] = torch.tensor(vision["grid"])
    return pack


def _shared_prompt_pack(model, g: torch.Generator) -> dict:
    """A prompt with an image computed once for two answers (`prefix_segments`: GRPO's and DPO's shared prompts):
    the prompt but its last token, then that token followed by each answer."""
    n = 4 * 6 // model.args.vision.spatial_merge_size**2
    prompt = torch.randint(2, 60, (3,), generator=g).tolist() + [model.args.image_token_id] * n + [7, 9]
    answers = [torch.randint(2, 60, (k,), generator=g).tolist() for k in (4, 3)]
    segments = [prompt[:-1]] + [prompt[-1:] + a for a in answers]
    train = [[False] * len(segments[0])] + [[False] + [True] * len(a) for a in answers]
    cu = torch.tensor([0, *torch.tensor([len(x) for x in segments]).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.tensor(sum(segments, []))
    return {"input_ids": ids[None], "cu_seqlens": cu, "labels": shifted_labels(ids, torch.tensor(sum(train, [])), cu)[None],
            "prefix_segments": torch.tensor([-1, 0, 0]),
            "pixel_values": torch.randn(24, _tower(model).patch_embed.patch_dim, generator=g),
            "image_grid_thw": torch.tensor([[1, 4, 6]])}


def _logp_and_grads(wrapper, batch):
    wrapper.zero_grad(set_to_none=True)
    logp = wrapper(batch)
    (-logp.sum()).backward()
    return logp.detach(), {n: p.grad.clone() for n, p in wrapper.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", [*sorted(FAMILIES), "qwen2_5_vl shared prompt"])
def test_training_forward_reads_no_device_value(family):
    make_config, kind = FAMILIES[family.split()[0]]
    torch.manual_seed(0)
    wrapper = TokenLogprobModel(build_model(make_config())).train()
    g = torch.Generator().manual_seed(1)
    pack = _shared_prompt_pack(wrapper.model, g) if "shared" in family else _pack(wrapper.model, kind, g)
    want, want_grads = _logp_and_grads(wrapper, pack)  # the pack's own (host) tensors: no host copies to read

    reads = HostReads(host=[v for v in pack.values() if torch.is_tensor(v)])
    with reads:
        got, grads = _logp_and_grads(wrapper, moved_to(pack, torch.device("cpu"), copy=True))
    model_reads = {site: n for site, n in reads.sites.items() if "kernels/reference/" not in site[1]}
    assert not model_reads, f"{family}: host reads of device values:\n{reads.report()}"
    assert torch.equal(got, want)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name
