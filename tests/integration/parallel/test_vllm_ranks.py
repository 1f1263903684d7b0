"""vLLM rollout engines on several ranks of one torch.distributed job (vLLM's external-launcher executor;
marker `vllm`: runs in the environment docs/vllm.md builds, `bash .ci/vllm_tests.sh`).

Two gloo ranks, a tiny random Qwen2 text folder, the trainer's weights perturbed away from the folder and
sharded with FSDP2 over both ranks, pushed into each rank's engine in 1 MiB buckets (each rank gathering the
shards layer by layer). The references are not the code under test: the built-in engine's greedy decode and
our training forward on an unsharded copy of the same weights.

- one engine per rank, each on its share of the prompts (prompts[rank::2], as rl/rounds.py deals them):
  greedy tokens equal the built-in engine's on the same prompts (so the two ranks together produce what one
  process produces for all prompts), and the log-probs of sampled tokens equal the training forward's
  log_softmax(logits / T) within 1e-4 (fp32);
- closing the engines leaves the job's process group working (vLLM's shutdown would destroy it);
- rl.vllm.tensor_parallel_size = 2: one engine sharded over both ranks (each rank holds half of the attention
  heads), both ranks sending all prompts: greedy tokens equal the built-in engine's, sampled log-probs equal
  the training forward's within 1e-4, and both ranks get the same completions;
- a stop signal seen by one rank of a tensor-parallel engine: both ranks give the call up before the same engine
  step (no rank left in a forward's collective), both engines empty and generating together after; likewise a
  multi-turn rollout whose environment wait one rank gave up; the engine starts beside a segment left at the
  name vLLM's CPU communicator uses, and unlinks its own at close.
"""
from __future__ import annotations

import faulthandler
import importlib.util
import os
import re
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.vllm, pytest.mark.distributed,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed here (run these tests in the vLLM environment: docs/vllm.md, "
                                        "'Running the vLLM tests')")]

NEW = 10
TEXTS = ["what is two plus two", "the cat sat on the", "seven eight nine", "hello", "one two", "a b c d e"]


def _trainer_and_reference(folder: Path):
    """The trainer's model (perturbed, then FSDP2-sharded over the world) and an unsharded copy of its weights."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from megatron_vlm.checkpoint.hf import load_hf_model
    from megatron_vlm.parallel.apply import apply_fsdp

    model = load_hf_model(str(folder), dtype=torch.float32, device="cpu").eval()
    g = torch.Generator().manual_seed(7)  # the same perturbation on every rank: "trained" weights
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    reference = copy.deepcopy(model)
    blocks = [m for n, m in model.named_modules() if re.fullmatch(r".*layers\.\d+", n)]
    assert blocks
    apply_fsdp(model, init_device_mesh("cpu", (dist.get_world_size(),)), blocks)
    assert any(type(p).__name__ == "DTensor" for p in model.parameters())  # sharded: the push gathers
    return model, reference


def _engine(folder: Path, model, *, tp: int):
    from megatron_vlm.data.processor import load_processor
    from megatron_vlm.inference.stopping import eos_token_ids_of
    from megatron_vlm.inference.vllm_engine import VLLMRolloutEngine
    from megatron_vlm.rl.config import VLLMConfig

    tok = load_processor(str(folder)).tokenizer
    cfg = VLLMConfig(max_num_seqs=16, cpu_kv_cache_gib=1, weight_bucket_mb=1, tensor_parallel_size=tp)
    return VLLMRolloutEngine(str(folder), cfg, dtype=torch.float32, device="cpu", max_model_len=256, seed=0,
                             sync_from=model, eos_token_ids=sorted(eos_token_ids_of(tok)), executor="external_launcher")


def _check_against_references(engine, reference, tok, prompts, seed: int, T=0.8):
    """Greedy = the built-in engine's; sampled log-probs = the training forward's (1e-4). The samples back.
    `seed`: the sampling generator's (the ranks of one tensor-parallel engine must send the same requests)."""
    from megatron_vlm.inference.engine import SamplingParams
    from megatron_vlm.inference.policy_engine import PolicyRolloutEngine

    greedy = SamplingParams(max_new_tokens=NEW, n=1, temperature=0.0)
    theirs = [s.token_ids.tolist() for s in engine.generate(prompts, greedy).samples]
    ours = [s.token_ids.tolist() for s in PolicyRolloutEngine(reference, tok).generate(prompts, greedy).samples]
    assert theirs == ours
    res = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, n=2, temperature=T),
                          generator=torch.Generator().manual_seed(seed))
    n = 0
    for s in res.samples:
        p = prompts[s.prompt_index].input_ids
        with torch.no_grad():
            logits = reference(input_ids=torch.cat([p, s.token_ids])[None])[0].float()
        lp = torch.log_softmax(logits[len(p) - 1: -1] / T, dim=-1).gather(-1, s.token_ids[:, None])[:, 0]
        torch.testing.assert_close(s.logprobs, lp, atol=1e-4, rtol=0)
        n += s.token_ids.numel()
    assert n > 2 * len(prompts)
    return theirs, res.samples


def _ranks_part(tmp: Path, rank: int) -> None:
    from megatron_vlm.data.processor import load_processor
    from megatron_vlm.inference.engine import RolloutPrompt
    from megatron_vlm.inference.vllm_weights import hf_weight_buckets
    from megatron_vlm.parallel.collectives import all_gather_objects
    from megatron_vlm.testing.synthesize import synthesize_model_folder

    folder = tmp / "qwen2"
    if rank == 0:
        synthesize_model_folder("tiny_qwen2", folder, seed=0)
    dist.barrier()
    model, reference = _trainer_and_reference(folder)
    tok = load_processor(str(folder)).tokenizer
    prompts = [RolloutPrompt(input_ids=torch.tensor(tok(t)["input_ids"], dtype=torch.long)) for t in TEXTS]
    # the push's buckets: bounded (a larger tensor alone), several, full tensors gathered from the shards
    buckets = list(hf_weight_buckets(model, 1 << 20))
    assert len(buckets) > 1
    assert all(len(b) == 1 or sum(t.numel() * t.element_size() for _, t in b) <= 1 << 20 for b in buckets)
    full = dict(reference.state_dict())
    assert sum(len(b) for b in buckets) >= len([k for k in full if "layers" in k])

    # one engine per rank, each on its share
    engine = _engine(folder, model, tp=1)
    try:
        engine.load_weights(None, version=1)
        assert engine.policy_version == 1 and engine.weight_push_mb > 0
        mine = prompts[rank::2]
        greedy, _ = _check_against_references(engine, reference, tok, mine, seed=rank + 1)
    finally:
        engine.close()
    assert dist.is_initialized()
    dist.barrier()  # the job's group outlives the engine
    shares = all_gather_objects(greedy)
    assert shares[0] != shares[1]  # the ranks did generate different prompts

    # one engine sharded over both ranks (tensor_parallel_size = 2), every rank sending all prompts
    engine = _engine(folder, model, tp=2)
    try:
        engine.load_weights(None, version=2)
        heads = engine.llm.collective_rpc(_qkv_rows)
        greedy_tp, samples = _check_against_references(engine, reference, tok, prompts, seed=5)
    finally:
        engine.close()
    dist.barrier()
    assert heads[0] == (2, _full_qkv_rows(reference) // 2), (heads, _full_qkv_rows(reference))  # half the heads each
    both = all_gather_objects((greedy_tp, [s.token_ids.tolist() for s in samples]))
    assert both[0] == both[1]
    # the two one-rank engines together = the sharded engine on all prompts
    assert [shares[i % 2][i // 2] for i in range(len(prompts))] == greedy_tp


def _qkv_rows(worker) -> tuple[int, int]:
    """In the vLLM worker: (vLLM's tensor-parallel size, output rows of the first layer's fused q/k/v projection
    on this rank). The rows are the layer's own count: the CPU build repacks the weight tensor itself."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    model = worker.model_runner.get_model()
    qkv = next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn.qkv_proj"))
    return get_tensor_model_parallel_world_size(), int(qkv.output_size_per_partition)


def _full_qkv_rows(reference) -> int:
    sd = reference.state_dict()
    return sum(int(sd[k].shape[0]) for k in sd if re.search(r"layers\.0\.self_attn\.[qkv]_proj\.weight$", k))


@pytest.mark.heavy  # two processes, three vLLM engines: ~2.5-3 min at load 15; `bash .ci/vllm_tests.sh -m vllm`
def test_vllm_engines_on_two_ranks_and_tensor_parallel_2(tmp_path):
    from tests.integration.parallel.spawn import spawn

    spawn(tmp_path, _ranks_part, world=2)


class _GivesUpOnRank0:
    """A multi-turn environment whose first step's wait rank 0 gives up (its stop check, not yet agreed: the env
    pool's `WaitAbandoned`) while rank 1's environments answer: a short user turn, then done."""

    def __init__(self, rank: int, reply_ids: list[int]):
        self.rank, self.reply_ids, self.calls = rank, reply_ids, 0

    def step(self, items):
        from megatron_vlm.abandon import WaitAbandoned
        from megatron_vlm.inference.multiturn import TurnChunk, TurnReply

        self.calls += 1
        if self.rank == 0:
            raise WaitAbandoned.of(len(items), "environments")
        if self.calls > 1:
            return [TurnReply(done=True) for _ in items]
        return [TurnReply(chunk=TurnChunk(input_ids=torch.tensor(self.reply_ids))) for _ in items]


class _FailsOnRank1(_GivesUpOnRank0):
    """The same environments, but rank 1's runner raises at its first step (an error of that rank only, not an error
    reply) while rank 0's answer."""

    def step(self, items):
        from megatron_vlm.inference.multiturn import TurnChunk, TurnReply

        self.calls += 1
        if self.rank == 1:
            raise RuntimeError("the runner broke on rank 1")
        if self.calls > 1:
            return [TurnReply(done=True) for _ in items]
        return [TurnReply(chunk=TurnChunk(input_ids=torch.tensor(self.reply_ids))) for _ in items]


def _decoy_segment(rank: int) -> Optional[str]:
    """The shared-memory segment vLLM's CPU communicator names for this rank of the tp group [0, 1] (its identifier
    is empty under the external launcher), as a crashed engine or another job's would leave it; None if one is there
    already (another run's: it blocks the same way and is not ours to remove)."""
    import _posixshmem

    name = f"/-tp:0-[0-1]-cpushm_{rank}"
    try:
        os.close(_posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600))
    except FileExistsError:
        return None
    return name


def _stop_part(tmp: Path, rank: int) -> None:
    """One engine sharded over both ranks; only rank 0's stop check says stop (its signal, not yet agreed)."""
    import _posixshmem

    from megatron_vlm import abandon
    from megatron_vlm.abandon import WaitAbandoned
    from megatron_vlm.data.processor import load_processor
    from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
    from megatron_vlm.inference.multiturn import MultiTurnLimits
    from megatron_vlm.inference.vllm_multiturn import VLLMMultiTurnRollout
    from megatron_vlm.parallel.collectives import all_gather_objects
    from megatron_vlm.testing.synthesize import synthesize_model_folder

    abandon.ABANDON_GRACE_S = 0.0
    folder = tmp / "qwen2"
    if rank == 0:
        synthesize_model_folder("tiny_qwen2", folder, seed=0)
    dist.barrier()
    model, _ = _trainer_and_reference(folder)
    tok = load_processor(str(folder)).tokenizer
    prompts = [RolloutPrompt(input_ids=torch.tensor(tok(t)["input_ids"], dtype=torch.long)) for t in TEXTS]
    decoy = _decoy_segment(rank)  # a segment left at vLLM's own name does not stop this engine (vllm_cpu_shm.py)
    try:
        engine = _engine(folder, model, tp=2)
    finally:
        if decoy is not None:
            _posixshmem.shm_unlink(decoy)
    segments = engine._shm_segments.names
    assert len(segments) == 1 and all(Path("/dev/shm", s).exists() for s in segments), segments
    step, steps = engine.llm.llm_engine.step, [0]

    def counted():
        steps[0] += 1
        return step()

    engine.llm.llm_engine.step = counted
    long = SamplingParams(max_new_tokens=200, n=2, temperature=1.0)
    faulthandler.dump_traceback_later(240, exit=True)  # a rank left in a collective hangs: fail instead
    try:
        engine.load_weights(None, version=1)
        with pytest.raises(WaitAbandoned) as e:
            engine.generate(prompts, long, generator=torch.Generator().manual_seed(3),
                            abandon=lambda: rank == 0 and steps[0] >= 3)
        left = (steps[0], str(e.value), engine.llm.llm_engine.has_unfinished_requests())
        # a multi-turn rollout whose environment wait rank 0 gives up between two engine steps: both ranks leave
        # (every turn may end on one of many ids, so the environments are called after a few steps)
        engine.eos_token_ids = list(range(0, len(tok), 3))
        source = _GivesUpOnRank0(rank, tok("ok")["input_ids"])
        with pytest.raises(WaitAbandoned) as mt:
            VLLMMultiTurnRollout(engine, tokenizer=tok).generate(
                prompts, SamplingParams(max_new_tokens=8, n=1, temperature=1.0), source,
                MultiTurnLimits(max_turns=3, max_total_tokens=200), seed=1, abandon=lambda: False)
        env_left = (source.calls, mt.value.waited_for, engine.llm.llm_engine.has_unfinished_requests())
        # an error on rank 1 only between two steps, no stop check: every rank raises at the same agreement
        with pytest.raises(RuntimeError) as err:
            VLLMMultiTurnRollout(engine, tokenizer=tok).generate(
                prompts, SamplingParams(max_new_tokens=8, n=1, temperature=1.0), _FailsOnRank1(rank, source.reply_ids),
                MultiTurnLimits(max_turns=3, max_total_tokens=200), seed=1)
        failed = (type(err.value).__name__, str(err.value), engine.llm.llm_engine.has_unfinished_requests())
        # both ranks step on together afterwards (a rank left behind would hang in this call's forwards)
        after = engine.generate(prompts, SamplingParams(max_new_tokens=4, n=1, temperature=0.0), abandon=lambda: False)
    finally:
        engine.llm.llm_engine.step = step
        engine.close()
    faulthandler.cancel_dump_traceback_later()
    assert not any(Path("/dev/shm", s).exists() for s in segments)  # released at close, not at process exit
    both = all_gather_objects((left, [s.token_ids.tolist() for s in after.samples], env_left, failed))
    assert [b[0][0] for b in both] == [3, 3], both  # every rank left before its 4th step
    assert "after 3 engine steps: the rank is stopping" in both[0][0][1]
    assert "another rank of the tensor-parallel engine is stopping" in both[1][0][1]
    assert not both[0][0][2] and not both[1][0][2]
    assert both[0][1] == both[1][1] and len(both[0][1]) == len(TEXTS)
    assert both[0][2] == (1, "environments", False), both  # rank 0: its own wait given up
    assert both[1][2][0] >= 1 and both[1][2][1:] == ("generation", False), both  # rank 1: left with it, engine empty
    assert both[1][3] == ("RuntimeError", "the runner broke on rank 1", False), both  # its own error
    assert both[0][3][0] == "RankFailed" and "another rank" in both[0][3][1] and not both[0][3][2], both


# two processes, one vLLM engine over both: 23 s in the CI stage at load 2-3, ~45 s alone at load ~5. Heavy (left out
# of CI): the shared-memory name collision that made it flaky is fixed (inference/vllm_cpu_shm.py), but 2 of 18 runs
# beside the file's other tensor-parallel test ended in a SIGABRT inside vLLM ("terminate called without an active
# exception") that is not understood; run it with `bash .ci/vllm_tests.sh -m vllm`
@pytest.mark.heavy
def test_a_stop_on_one_rank_of_a_tensor_parallel_engine_stops_every_rank_at_the_same_step(tmp_path):
    """rl.vllm.tensor_parallel_size = 2 and a stop signal that only rank 0 has seen yet: the engine's ranks agree at
    every engine step (`give_up_at_step`), so both give the call up before the same step instead of rank 0 leaving
    alone and rank 1 waiting in the next forward's collective; both engines are empty and generate together after.
    The same for a multi-turn rollout whose environment wait only rank 0 gives up (`leave_together`), and for one
    whose environment runner raises on rank 1 only, without a stop check (every rank raises together). The engine
    starts though a shared-memory segment is left at the name vLLM's CPU communicator would use, and removes its own
    segment when it closes."""
    from tests.integration.parallel.spawn import spawn

    spawn(tmp_path, _stop_part, world=2)
