"""GRPO / PPO with Nemotron-VL prompts whose videos have different tile sizes (frames of other aspect ratios).

Nemotron-VL keeps each video's frames as [frames, 3, H, W] at the video's own tile size, so two such videos cannot
be concatenated into one model input. The rollout engine prefilled every admitted prompt in one forward and the
training forwards (policy, reference, old log-probs, the PPO critic) packed samples by token count alone: a batch
mixing two tile sizes failed with a RuntimeError in `torch.cat`, and the job with it. Now a prompt that cannot join
a prefill waits for the next admission round, and a sample that cannot join a pack starts the next one; the
completions are those each prompt gets alone and the packed log-probs those of the rollout.

Qwen2.5-VL / Qwen3-VL (flattened patches [patches, C*T*p*p] whatever the image size) and InternVL (448 x 448 tiles)
concatenate any mix: their prompts never conflict, checked here too.
"""
from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.data.messages import Record, normalize_messages
from megatron_vlm.data.packing import vision_shape_conflict
from megatron_vlm.data.processing import process_record
from megatron_vlm.data.processor import load_processor
from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine, vision_token_ids
from megatron_vlm.rl.batching import (
    TrainSample,
    group_by_prompt,
    pack_samples,
    plan_micro_batches,
    plan_shared_micro_batches,
)
from megatron_vlm.rl.policy_update import PolicyUpdate
from megatron_vlm.testing.synthesize import synthesize_model_folder
from megatron_vlm.testing.tiny_nemotron_vl import add_tiny_video_processing
from megatron_vlm.training.lm_loss import TokenLogprobModel


def _frames(folder, name: str, size: tuple[int, int], n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        path = folder / f"{name}{i}.png"
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
        out.append(str(path))
    return out


def _prompt(proc, content: list, index: int) -> RolloutPrompt:
    rec = Record(normalize_messages([{"role": "user", "content": content}, {"role": "assistant", "content": "x"}]), "mem", index)
    return RolloutPrompt.from_processed(process_record(rec, proc, max_frames=3, for_generation=True))


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nem")
    folder = add_tiny_video_processing(synthesize_model_folder("tiny_nemotron_vl", tmp / "nem", seed=0))
    model, proc = load_hf_model(str(folder)).eval(), load_processor(str(folder))
    wide, tall = (_frames(tmp, name, size, 2, seed) for name, size, seed in (("w", (96, 40), 1), ("t", (40, 96), 2)))
    prompts = [_prompt(proc, [{"type": "video", "video": v}, {"type": "text", "text": "what?"}], i)
               for i, v in enumerate((wide, tall))]
    return model, proc, prompts


def test_the_two_videos_cannot_share_a_tensor(nemotron):
    _, _, (wide, tall) = nemotron
    assert wide.pixel_values_videos.shape[1:] != tall.pixel_values_videos.shape[1:]
    assert vision_shape_conflict([wide], tall)


def test_rollout_prefills_each_tile_size_apart_with_the_completions_of_each_prompt_alone(nemotron):
    model, proc, prompts = nemotron
    params = SamplingParams(max_new_tokens=3, n=2, temperature=0.0)
    engine = PolicyRolloutEngine(model, proc.tokenizer, EngineOptions(eos_token_ids=[-1]))
    res = engine.generate(prompts, params)  # was: RuntimeError from torch.cat in the prefill
    assert res.stats["prefill_calls"] == 2  # one per tile size
    assert [(s.prompt_index, len(s.token_ids)) for s in res.samples] == [(0, 3), (0, 3), (1, 3), (1, 3)]
    for i, p in enumerate(prompts):
        alone = engine.generate([p], params).samples
        for a, b in zip(alone, [s for s in res.samples if s.prompt_index == i]):
            assert a.token_ids.tolist() == b.token_ids.tolist()
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def _samples(nemotron) -> list[TrainSample]:
    model, proc, prompts = nemotron
    res = PolicyRolloutEngine(model, proc.tokenizer).generate(
        prompts + prompts[:1], SamplingParams(max_new_tokens=3, n=2, temperature=1.0),
        generator=torch.Generator().manual_seed(0))
    return [TrainSample(prompt=(prompts + prompts[:1])[s.prompt_index], response_ids=s.token_ids,
                        behav_logp=s.logprobs, advantage=1.0) for s in res.samples]


def test_training_packs_split_where_a_video_cannot_join_and_give_the_rollout_logprobs(nemotron):
    model = nemotron[0]
    samples = _samples(nemotron)  # wide, wide, tall, tall, wide, wide
    with pytest.raises(RuntimeError):  # what one pack by token count did
        pack_samples(samples)
    ids = frozenset(vision_token_ids(model))
    # the planner of the policy, reference, old log-prob and critic packs (a Mamba decoder shares no prompts)
    groups = PolicyUpdate.packs(NS(share_prompts=False, max_tokens=10_000, vision_ids=ids), samples)
    assert [len(g) for g in groups] == [2, 2, 2]
    masked = tuple(vision_token_ids(model))
    for group in groups:
        batch = pack_samples(group, vision_token_ids=ids)
        batch.pop("num_response_tokens")
        with torch.no_grad():
            logp = TokenLogprobModel(model)(batch, masked_token_ids=masked)
        torch.testing.assert_close(logp, torch.cat([s.behav_logp for s in group]), atol=1e-4, rtol=0)


def test_planners_split_only_where_vision_conflicts(nemotron):
    samples = _samples(nemotron)
    lengths = [s.num_tokens for s in samples]
    assert plan_micro_batches(lengths, 10_000) == [list(range(6))]  # token counts alone (the former planner)
    assert plan_micro_batches(lengths, 10_000, samples) == [[0, 1], [2, 3], [4, 5]]
    grouped = group_by_prompt(samples)  # wide x 4 (the third prompt is the first one again), tall x 2
    assert plan_shared_micro_batches(grouped[:4], 10_000) == [[0, 1, 2, 3]]
    assert plan_shared_micro_batches(grouped, 10_000) == [[0, 1, 2, 3], [4, 5]]


@pytest.mark.parametrize("kind", ["tiny_qwen2_5_vl", "tiny_qwen3_vl", "tiny_internvl"])
def test_other_families_concatenate_images_of_any_size(kind, tmp_path):
    folder = synthesize_model_folder(kind, tmp_path / kind, seed=0)
    proc = load_processor(str(folder))
    images = [_frames(tmp_path, name, size, 1, seed)[0] for name, size, seed in (("w", (96, 40), 1), ("t", (40, 96), 2))]
    prompts = [_prompt(proc, [{"type": "image", "image": im}, {"type": "text", "text": "what?"}], i)
               for i, im in enumerate(images)]
    assert prompts[0].pixel_values is not None and prompts[1].pixel_values is not None
    assert not vision_shape_conflict([prompts[0]], prompts[1])
