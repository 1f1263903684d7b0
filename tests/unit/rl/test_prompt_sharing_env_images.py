"""Prompt sharing with multi-turn trajectories of which only some carry an environment's images ([rl.env] zoom).

A group of trajectories of one prompt: those whose environment showed no image share the prompt, one that carries
an image has its own copy (its images follow the prompt's in placeholder order). The planner
(`plan_shared_micro_batches`) costs each sample that way, so the pack `pack_samples` builds from its plan must
hold no more than data.max_tokens_per_pack tokens; a run mixing both kinds used to be packed with every prompt
copied (a pack far over the budget the planner had kept to). Sizes are derived by hand below; the log-probs of the
mixed shared pack are those of the plain one (every sample with its own prompt) on a tiny Qwen2.5-VL.
"""
import torch

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.data.processor import load_processor
from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa
from megatron_vlm.inference.engine import RolloutPrompt
from megatron_vlm.rl.batching import TrainSample, pack_samples, plan_shared_micro_batches
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
from megatron_vlm.rl.prompts.encoder import PromptEncoder
from megatron_vlm.training.lm_loss import TokenLogprobModel


def _sample(prompt, n: int, vision: bool) -> TrainSample:
    return TrainSample(prompt=prompt, response_ids=torch.arange(100, 100 + n), behav_logp=torch.zeros(n), advantage=1.0,
                       response_mask=torch.ones(n, dtype=torch.bool),
                       response_vision={"pixel_values": torch.zeros(4, 8)} if vision else None)


def test_a_planned_pack_keeps_to_the_budget_when_a_group_mixes_env_images():
    prompt = RolloutPrompt(torch.arange(10, 30))  # 20 tokens
    samples = [_sample(prompt, 5, True), *(_sample(prompt, 5, False) for _ in range(3))]
    # planned costs: 25 (own prompt), 25 (the first of the shared ones), 6, 6 = 62 <= 70: one pack
    assert plan_shared_micro_batches(samples, 70) == [[0, 1, 2, 3]]
    batch = pack_samples(samples, share_prompts=True)
    # the image-bearing trajectory with its prompt: 20 + 5 - 1 (its final token left out) = 24; the other three
    # sharing one copy: 19 (prompt less its last token) + 3 x (1 + 5 - 1) = 34
    assert batch["input_ids"].shape[1] == 24 + 34 <= 70
    assert batch["cu_seqlens"].tolist() == [0, 24, 43, 48, 53, 58]
    assert batch["prefix_segments"].tolist() == [-1, -1, 1, 1, 1]
    assert batch["num_response_tokens"] == 20
    # an image-bearing trajectory between two plain ones: each plain one alone keeps its own prompt
    mixed = [_sample(prompt, 5, False), _sample(prompt, 5, True), _sample(prompt, 5, False)]
    assert pack_samples(mixed, share_prompts=True)["input_ids"].shape[1] == 3 * 24


def test_mixed_shared_pack_gives_the_plain_log_probs(tiny_vlm_folder, tmp_path):
    folder = tiny_vlm_folder
    model = load_hf_model(str(folder), dtype=torch.float32).eval()
    encoder = PromptEncoder(load_processor(str(folder)), max_frames=4, fps=2.0, max_new_tokens=5, max_tokens=4096)
    vqa = write_synthetic_vqa(tmp_path / "vqa", 2, 2, seed=0)["eval"]
    prompt, other = (encoder.encode(s) for s in load_prompt_dataset(vqa, schema="messages").samples[:2])
    g = torch.Generator().manual_seed(3)
    vocab = 100

    def plain(n: int) -> TrainSample:
        return TrainSample(prompt=prompt, response_ids=torch.randint(0, vocab, (n,), generator=g),
                           behav_logp=torch.zeros(n), advantage=1.0)

    # an environment turn with an image (another prompt's tokens and pixels) between two model turns
    env = other.input_ids
    ids = torch.cat([torch.randint(0, vocab, (3,), generator=g), env, torch.randint(0, vocab, (2,), generator=g)])
    mask = torch.cat([torch.ones(3, dtype=torch.bool), torch.zeros(env.numel(), dtype=torch.bool),
                      torch.ones(2, dtype=torch.bool)])
    with_image = TrainSample(prompt=prompt, response_ids=ids, behav_logp=torch.zeros(5), advantage=1.0,
                             response_mask=mask, response_vision={"pixel_values": other.pixel_values,
                                                                  "image_grid_thw": other.image_grid_thw})
    samples = [with_image, plain(4), plain(3)]
    budget = sum(s.num_tokens for s in samples)
    assert plan_shared_micro_batches(samples, budget) == [[0, 1, 2]]
    shared = pack_samples(samples, share_prompts=True)
    unshared = pack_samples(samples)
    assert "prefix_segments" in shared  # the two plain trajectories share the prompt
    assert shared["input_ids"].shape[1] == unshared["input_ids"].shape[1] - (len(prompt) - 1)
    wrapper = TokenLogprobModel(model)
    with torch.no_grad():
        lp_shared = wrapper({k: v for k, v in shared.items() if k != "num_response_tokens"})
        lp_plain = wrapper({k: v for k, v in unshared.items() if k != "num_response_tokens"})
    assert lp_plain.numel() == 5 + 4 + 3
    torch.testing.assert_close(lp_shared, lp_plain, atol=2e-5, rtol=0)


def test_multiturn_labels_and_routes_by_hand():
    """Prompt [10, 11, 12]; trajectory a = model 20 21 | environment 30 31 | model 22, b = model 40 | env 50 | model
    41. Each route row holds the index of the token it was recorded for (a: 0.., b: 100..), prompt + L - 1 rows.
    Expected, derived by hand: a label where the NEXT token is a model token; the final token of each trajectory
    left out; with the prompt shared, b's continuation starts at its copy of the prompt's last token (row 102)."""
    prompt = RolloutPrompt(torch.tensor([10, 11, 12]))

    def traj(ids, mask, base):
        n = 3 + len(ids) - 1
        return TrainSample(prompt=prompt, response_ids=torch.tensor(ids), behav_logp=torch.zeros(sum(mask)),
                           advantage=1.0, response_mask=torch.tensor(mask),
                           routes=(torch.arange(n) + base).to(torch.int8).view(n, 1, 1))

    a = traj([20, 21, 30, 31, 22], [True, True, False, False, True], 0)
    b = traj([40, 50, 41], [True, False, True], 100)
    x = -100
    plain = pack_samples([a, b])
    assert plain["input_ids"].tolist() == [[10, 11, 12, 20, 21, 30, 31, 10, 11, 12, 40, 50]]
    assert plain["labels"].tolist() == [[x, x, 20, 21, x, x, 22, x, x, 40, x, 41]]
    assert plain["routes"].view(-1).tolist() == [0, 1, 2, 3, 4, 5, 6, 100, 101, 102, 103, 104]
    assert plain["cu_seqlens"].tolist() == [0, 7, 12] and plain["num_response_tokens"] == 5
    shared = pack_samples([a, b], share_prompts=True)
    assert shared["input_ids"].tolist() == [[10, 11, 12, 20, 21, 30, 31, 12, 40, 50]]
    assert shared["labels"].tolist() == [[x, x, 20, 21, x, x, 22, 40, x, 41]]
    assert shared["routes"].view(-1).tolist() == [0, 1, 2, 3, 4, 5, 6, 102, 103, 104]
    assert shared["cu_seqlens"].tolist() == [0, 2, 7, 10] and shared["prefix_segments"].tolist() == [-1, 0, 0]
