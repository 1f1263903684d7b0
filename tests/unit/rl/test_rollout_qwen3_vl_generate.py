"""The built-in rollout engine on a tiny random Qwen3-VL against transformers' `generate` on the same weights, with
what the Qwen2.5-VL engine test does not hold: a video (per-frame runs with timestamps) at the very start of a
prompt, an image as its last vision run, a text-only prompt beside them, left-padded prompts of different lengths in
transformers' batch. Greedy tokens equal token for token in the slot layout and in the paged pool."""
import pytest
import torch

import megatron_vlm.testing.tiny_processor_qwen3_vl as F
from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
from megatron_vlm.models import build_model
from megatron_vlm.models.qwen3_vl.state_dict_adapter import Qwen3VLStateDictAdapter
from tests.fixtures.parity import load_converted
from tests.fixtures.rollout_engine import make_engine

VISION = [F.IMAGE_TOKEN_ID, F.VIDEO_TOKEN_ID, F.VISION_START_TOKEN_ID, F.VISION_END_TOKEN_ID]
STEPS = 6


class _Tokenizer:
    pad_token_id = F.PAD_TOKEN_ID
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):  # noqa: ARG002
        return ""


@pytest.fixture(scope="module")
def setup():
    hf = F.hf_reference_model(seed=0)
    ours = build_model(F.tiny_qwen3_vl_config_dict())
    ours = load_converted(ours, Qwen3VLStateDictAdapter(ours.args), hf.state_dict())
    g = torch.Generator().manual_seed(3)
    samples = [F.build_sample(p, g) for p in ([("video", (2, 4, 2)), 3], [5], [1, ("video", (2, 2, 2)), ("image", (1, 2, 6)), 2])]
    batch = {k: v for k, v in F.batch_samples(samples, padding_side="left").items() if v is not None}
    with torch.no_grad():
        ref = hf.generate(**batch, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, suppress_tokens=VISION)
    prompts = [RolloutPrompt(torch.tensor(s["input_ids"]), s["pixel_values"], s["image_grid_thw"],
                             pixel_values_videos=s["pixel_values_videos"], video_grid_thw=s["video_grid_thw"])
               for s in samples]
    return ours, prompts, ref[:, batch["input_ids"].shape[1]:]


@pytest.mark.parametrize("options", [{}, {"kv_block_size": 4}], ids=["slots", "paged"])
def test_greedy_equals_transformers_generate(setup, options):
    ours, prompts, expect = setup
    res = make_engine(ours, _Tokenizer(), eos_token_ids=[-1], **options).generate(
        prompts, SamplingParams(max_new_tokens=STEPS, temperature=0.0))
    assert [s.prompt_index for s in res.samples] == [0, 1, 2]
    for s in res.samples:
        assert s.token_ids.tolist() == expect[s.prompt_index].tolist(), s.prompt_index
