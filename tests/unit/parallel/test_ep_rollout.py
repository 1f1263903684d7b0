"""The expert-parallel rollout copy (rl.rollout.weights = "expert_parallel") against one process on the full model.

Two gloo processes, parallel.ep = 2. The trainer stand-in is the full model with its experts sharded over the
ranks (`apply_ep`) and, for the refresh check, its dense weights FSDP-sharded on the same mesh (the trainer's
layout). Each rank decodes its own prompts with its own budget (rank 1 finishes first and takes empty lock-step
steps); the greedy tokens, behaviour log-probs and recorded routes must equal an ordinary one-process
`PolicyRolloutEngine` over the full model, in eager and in static (CUDA-graph form) decode steps. After an AdamW step of the trainer, `load_weights(None)` must leave
the copy equal to the trainer's new weights (dense gathered, experts this rank's slice), and decoding must equal
the one-process engine on the gathered new weights.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.data.processor import load_processor
from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa
from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
from megatron_vlm.models.common.moe import moe_layers
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
from megatron_vlm.rl.prompts.encoder import PromptEncoder
from megatron_vlm.testing.synthesize import synthesize_model_folder

pytestmark = [pytest.mark.distributed, pytest.mark.heavy]  # two spawned processes, three tiny models

WORLD = 2
KINDS = ["tiny_qwen3_moe", "tiny_qwen3_vl_moe", "tiny_nemotron_vl"]
BUDGETS = (6, 3)  # rank 0 decodes longer: rank 1 steps dummy rows meanwhile
PER_RANK = 2


def _prompts(kind: str, folder, root, vocab: int) -> list[RolloutPrompt]:
    if kind == "tiny_qwen3_moe":
        g = torch.Generator().manual_seed(1)
        return [RolloutPrompt(torch.randint(0, vocab, (n,), generator=g)) for n in (7, 12, 4, 9)]
    proc = load_processor(str(folder))
    vqa = write_synthetic_vqa(root / f"vqa_{kind}", 4, 4, seed=0)["eval"]
    encoder = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=max(BUDGETS), max_tokens=4096)
    out = [encoder.encode(s) for s in load_prompt_dataset(vqa, schema="messages").samples]
    assert len(out) >= WORLD * PER_RANK
    return out[:WORLD * PER_RANK]


def _generate(engine, prompts, budget):
    return engine.generate(prompts, SamplingParams(max_new_tokens=budget, n=2, temperature=0.0)).samples


def _same(got, want, what):
    assert len(got) == len(want), what
    for a, b in zip(got, want):
        assert torch.equal(a.token_ids, b.token_ids), what
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0, msg=what)
        assert a.routes is not None and torch.equal(a.routes, b.routes), what


def _full_experts(trainer, name_of):
    """The trainer's weights with every sharded tensor gathered (DTensor full_tensor): the one-process model's."""
    out = {}
    for name, t in trainer.state_dict().items():
        out[name_of(name)] = t.full_tensor() if hasattr(t, "full_tensor") else t
    return out


def _worker(rank: int, init_file: str, folders: dict, root) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from megatron_vlm.inference.ep_rollout import ExpertParallelRolloutEngine, build_ep_rollout_copy
        from megatron_vlm.parallel.collectives import any_rank
        from megatron_vlm.parallel.expert_parallel import apply_ep, expert_parameters

        mesh = init_device_mesh("cpu", (WORLD,))
        for kind in KINDS:
            folder = folders[kind]
            tok = load_processor(str(folder)).tokenizer
            full = load_hf_model(str(folder), dtype=torch.float32).eval()
            prompts = _prompts(kind, folder, root, full.lm_head.weight.shape[0])
            mine, budget = prompts[rank * PER_RANK:(rank + 1) * PER_RANK], BUDGETS[rank]
            opts = EngineOptions(eos_token_ids=[-1], record_routes=True)
            want = _generate(PolicyRolloutEngine(full, tok, opts), mine, budget)

            # the trainer's layout: experts sharded over the ep mesh (DTensors), the rest FSDP-sharded on it
            trainer = load_hf_model(str(folder), dtype=torch.float32)
            layers = moe_layers(trainer)
            apply_ep(layers, mesh)
            fully_shard(trainer, mesh=mesh, ignored_params=set(expert_parameters(trainer)))
            group = mesh.get_group()
            copy = build_ep_rollout_copy(trainer, folder, dtype=torch.float32, device="cpu", ep_group=group)
            n_local = layers[0].num_experts // WORLD
            for m in moe_layers(copy):
                assert m.experts.down_proj.shape[0] == n_local  # this rank's experts only
                assert not hasattr(m.experts.down_proj, "full_tensor")
            engine = ExpertParallelRolloutEngine(copy, tok, opts, trainer=trainer,
                                                 all_ranks_active=lambda a: any_rank(a, torch.device("cpu")))
            got = _generate(engine, mine, budget)
            _same(got, want, f"{kind} rank {rank}")
            assert all(len(s.token_ids) == budget for s in got)
            static = ExpertParallelRolloutEngine(copy, tok, EngineOptions(eos_token_ids=[-1], record_routes=True,
                                                                          cuda_graphs="on"), trainer=trainer,
                                                 all_ranks_active=lambda a: any_rank(a, torch.device("cpu")))
            _same(_generate(static, mine, budget), want, f"{kind} rank {rank}, static (CUDA-graph form) steps")

            # an optimizer step of the trainer, then the refresh
            trainer.train()
            ids = torch.randint(0, full.lm_head.weight.shape[0], (1, 8), generator=torch.Generator().manual_seed(rank))
            opt = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
            out = trainer(input_ids=ids)
            logits = out.logits if hasattr(out, "logits") else out
            logits.float().pow(2).mean().backward()
            opt.step()
            trainer.eval()
            engine.load_weights(None, version=1)
            assert engine.policy_version == 1
            trained = dict(trainer.named_parameters())
            changed = 0
            for name, p in copy.named_parameters():
                src = trained[name]
                src = src.to_local() if name in _expert_param_names(trainer) else (
                    src.full_tensor() if hasattr(src, "full_tensor") else src)
                assert torch.equal(p, src.detach()), name
                changed += int(not torch.equal(p, dict(full.named_parameters())[name][
                    rank * n_local:(rank + 1) * n_local] if name in _expert_param_names(trainer) else
                    dict(full.named_parameters())[name]))
            assert changed > 0  # the step moved the weights and the copy followed
            new_full = load_hf_model(str(folder), dtype=torch.float32).eval()
            new_full.load_state_dict(_full_experts(trainer, lambda n: n), strict=True)
            before = want
            want = _generate(PolicyRolloutEngine(new_full, tok, opts), mine, budget)
            assert any(not torch.allclose(a.logprobs, b.logprobs, atol=1e-3) for a, b in zip(want, before))
            _same(_generate(engine, mine, budget), want, f"{kind} rank {rank} after the step")
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _expert_param_names(model) -> set[str]:
    from megatron_vlm.inference.ep_rollout import _expert_names

    return _expert_names(model)


def test_expert_parallel_rollout_copy_equals_one_process_engine(tmp_path):
    folders = {kind: synthesize_model_folder(kind, tmp_path / kind, seed=0) for kind in KINDS}
    mp.spawn(_worker, args=(str(tmp_path / "store"), folders, tmp_path), nprocs=WORLD, join=True)
