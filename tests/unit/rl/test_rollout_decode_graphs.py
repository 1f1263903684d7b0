"""Decode steps on static per-bucket buffers (inference/decode_graphs.py, `cuda_graphs`): on the CPU the
same static step a CUDA graph captures runs eagerly, so everything but the capture is checked here.

- greedy rollouts through the static path equal the eager engine's (same tokens, log-probs within 1e-5,
  fp32) for a dense family (tiny Qwen2.5-VL, images in the prompts) and the Nemotron hybrid decoder
  (Mamba2 + attention, states per slot), with early finishes and refills so the batch crosses bucket
  sizes (rows padded onto the scratch slot); Qwen3-VL, InternVL and the text-only Qwen3 pass the probe and
  match too;
- the graph-safety probe reports a host read of a tensor value and an op sequence that follows the data;
- combinations that cannot work are refused ("on") or logged off ("auto") (the paged KV cache runs static
  steps: tests/unit/rl/test_rollout_paged_on_demand.py), and parameters that moved drop the graphs.
"""
import logging

import pytest
import torch

from megatron_vlm.inference import decode_graphs
from megatron_vlm.inference.decode_graphs import DecodeStepRunner, GraphUnsafeError, bucket_sizes
from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
from megatron_vlm.models import build_model
from megatron_vlm.models.common.slot_cache import SlotCache
from megatron_vlm.testing.tiny_nemotron_vl import build_tiny_nemotron_vl_tokenizer, tiny_nemotron_vl_hf_config
from tests.fixtures import tiny_qwen2_5_vl as F
from tests.fixtures.rollout_engine import make_engine


class Tok:
    pad_token_id = 0
    eos_token_id = -1  # never drawn

    def decode(self, ids, skip_special_tokens=False):
        return ""


def _qwen():
    torch.manual_seed(0)
    model = build_model(F.tiny_qwen2_5_vl_config_dict()).eval()
    g = torch.Generator().manual_seed(7)
    prompts = []
    for parts in ([2, ("image", (1, 4, 4)), 3], [5, 1], [1, ("image", (1, 4, 6)), 1, 6, 2], [4], [3, 2, 2]):
        s = F.build_sample(parts, g)
        prompts.append(RolloutPrompt(torch.tensor(s["input_ids"]), s["pixel_values"], s["image_grid_thw"]))
    return model, prompts


def _hybrid_config(moe: bool) -> dict:
    cfg = tiny_nemotron_vl_hf_config(build_tiny_nemotron_vl_tokenizer())
    if not moe:
        cfg["text_config"]["layers_block_type"] = ["linear_attention", "full_attention", "mlp", "linear_attention"]
    return cfg


def _nemotron():
    torch.manual_seed(0)
    model = build_model(_hybrid_config(moe=False)).eval()
    g = torch.Generator().manual_seed(0)
    return model, [RolloutPrompt(torch.randint(10, 200, (n,), generator=g)) for n in (5, 9, 3, 7, 4)]


def _generate(model, prompts, eos, mode, n=2):
    eng = PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=eos, max_num_seqs=5, cuda_graphs=mode))
    return eng.generate(prompts, SamplingParams(max_new_tokens=8, n=n, temperature=0.0)).samples


@pytest.mark.parametrize("family", ["qwen2_5_vl", "nemotron_hybrid"])
def test_static_steps_equal_eager_steps(family, monkeypatch):
    model, prompts = _qwen() if family == "qwen2_5_vl" else _nemotron()
    # end-of-sequence ids taken from an eager run with none: samples finish at different steps
    free = _generate(model, prompts, [-1], "off", n=1)
    eos = sorted({s.token_ids[k].item() for s, k in zip(free, (2, 5, 3, 6, 1))})
    ref = _generate(model, prompts, eos, "off")
    rows = []
    step = DecodeStepRunner.step

    def spy(self, slots, input_ids):
        rows.append(len(slots))
        return step(self, slots, input_ids)

    monkeypatch.setattr(DecodeStepRunner, "step", spy)
    got = _generate(model, prompts, eos, "on")
    assert len({len(s.token_ids) for s in ref}) > 1  # early finishes happened
    buckets = {next(b for b in bucket_sizes(5) if b >= r) for r in rows}
    assert len(buckets) >= 3 and any(r not in bucket_sizes(5) for r in rows), rows  # padded rows, several buckets
    assert [(s.prompt_index, s.sample_index) for s in got] == [(s.prompt_index, s.sample_index) for s in ref]
    for a, b in zip(ref, got):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        assert a.finish_reason == b.finish_reason
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-5, rtol=0)


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(5) == [1, 2, 4, 5]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    with pytest.raises(ValueError):
        bucket_sizes(0)


def _runner_on_cache(model, forward, probe=True):
    cache = SlotCache(model.new_cache(3, 16))
    prompt = model.new_cache(1, 4)
    model(input_ids=torch.tensor([[3, 4, 5, 6]]), kv_cache=prompt)
    cache.load_prefix([0, 1], prompt, 0)
    return DecodeStepRunner(forward, cache, pad_token_id=0, capture=False, probe=probe, params=list(model.parameters()))


def test_probe_reports_host_reads_and_data_dependent_ops():
    model, _ = _qwen()
    with torch.no_grad():
        def reads_a_value(**kw):
            logits = model(**kw)
            return logits * 2 if bool(kw["input_ids"].sum() > 0) else logits
        runner = _runner_on_cache(model, reads_a_value)
        with pytest.raises(GraphUnsafeError, match="host"):
            runner.step([0, 1], torch.tensor([7, 8]))

        def data_sized(**kw):
            logits = model(**kw)
            keep = sum(1 for t in kw["input_ids"].view(-1).tolist() if t == 7)  # invisible to the dispatcher on CPU
            return logits[:, :, : keep + 1]
        runner = _runner_on_cache(model, data_sized)
        runner.step([0, 1], torch.tensor([7, 8]))
        with pytest.raises(GraphUnsafeError, match="different ops"):
            runner.step([0, 1], torch.tensor([7, 7]))

        runner = _runner_on_cache(model, model)  # the real decode step is clean
        for ids in ([7, 8], [9, 9], [1, 2]):
            runner.step([0, 1], torch.tensor(ids))


def test_moved_parameters_drop_the_graphs(caplog):
    model, _ = _qwen()
    with torch.no_grad():
        runner = _runner_on_cache(model, model, probe=False)
        runner.step([0, 1], torch.tensor([7, 8]))
        runner._check_addresses()
        runner._check_addresses()
        assert runner.buckets  # same storage: kept
        p = next(model.parameters())
        p.data = p.data.clone()
        with caplog.at_level(logging.WARNING, logger=decode_graphs.__name__):
            runner._check_addresses()
        assert not runner.buckets and "reallocated" in caplog.text


def test_refused_and_auto_off_combinations(caplog):
    model, _ = _qwen()
    with pytest.raises(ValueError, match="cuda_graphs"):
        PolicyRolloutEngine(model, Tok(), EngineOptions(cuda_graphs="yes"))
    with pytest.raises(ValueError, match="cuda_graphs: 'on'"):
        make_engine(model, Tok(), cuda_graphs="on", forward=model)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        eng = make_engine(model, Tok(), cuda_graphs="auto", forward=model)
    # the default: on the CPU "auto" is eager steps anyway, so the trainer's model is no news worth a line
    assert eng.cuda_graphs == "off" and "CUDA graphs off" not in caplog.text
    with caplog.at_level(logging.INFO):
        eng = make_engine(model, Tok(), cuda_graphs="auto", forward=model, device="cuda")  # only constructed
    assert eng.cuda_graphs == "off" and "CUDA graphs off: the engine calls the trainer's model" in caplog.text
    assert make_engine(model, Tok(), cuda_graphs="on", kv_block_size=4).cuda_graphs == "on"  # the paged pool: static too
    eng = PolicyRolloutEngine(model, Tok(), EngineOptions(cuda_graphs="auto"))  # no CUDA device here: eager steps
    cache = SlotCache(model.new_cache(3, 8))
    assert (eng._decode_runner(cache) is None) == (cache.device.type != "cuda")
    on = PolicyRolloutEngine(model, Tok(), EngineOptions(cuda_graphs="on"))
    assert isinstance(on._decode_runner(cache), DecodeStepRunner)


def test_config_key_reaches_the_engine_moe_included(tmp_path):
    from types import SimpleNamespace

    from megatron_vlm.data.processor import load_processor
    from megatron_vlm.rl.trainer import build_rollout_engine
    from megatron_vlm.testing.synthesize import synthesize_model_folder
    from tests.fixtures.rl_config import rl_config

    rl_config(rollout_cuda_graphs="on", rollout_weights="copy").validate()
    rl_config(rollout_cuda_graphs="on", allocation="rollout:1+train:1").validate()  # rollout ranks hold a copy
    folder = synthesize_model_folder("tiny_nemotron_vl", tmp_path / "nemotron", seed=0)  # has a MoE layer: graph-safe now
    bundle = SimpleNamespace(model=None, processor=load_processor(str(folder)))
    kw = dict(dtype=torch.float32, device=torch.device("cpu"), per_batch=1)
    eng = build_rollout_engine(rl_config(rollout_weights="copy", rollout_cuda_graphs="on"), bundle, str(folder), **kw)
    assert eng.cuda_graphs == "on"
    dense = synthesize_model_folder("tiny_qwen2_5_vl", tmp_path / "qwen", seed=0)
    bundle = SimpleNamespace(model=None, processor=load_processor(str(dense)))
    eng = build_rollout_engine(rl_config(rollout_weights="copy", rollout_cuda_graphs="on"), bundle, str(dense), **kw)
    assert eng.cuda_graphs == "on" and eng.owns_forward


@pytest.mark.parametrize("kind", ["tiny_qwen3_vl", "tiny_internvl", "tiny_qwen3"])
def test_other_dense_families_pass_the_probe_and_match(kind, tmp_path):
    from megatron_vlm.checkpoint.hf import load_hf_model
    from megatron_vlm.testing.synthesize import synthesize_model_folder

    model = load_hf_model(str(synthesize_model_folder(kind, tmp_path / kind, seed=0))).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [RolloutPrompt(torch.randint(10, 100, (k,), generator=g)) for k in (5, 9, 3)]
    ref = _generate(model, prompts, [-1], "off")
    got = _generate(model, prompts, [-1], "on")
    for a, b in zip(ref, got):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-5, rtol=0)


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: replay re-runs the bucket's step and writes its output
    into the buffer captured first (a real replay writes the same tensors in place)."""

    def __init__(self):
        self.runner = self.bucket = None

    def replay(self):
        out = self.runner._step(self.bucket)
        self.bucket.logits.copy_(out)


def test_capture_control_flow_with_a_fake_cuda_graph(monkeypatch):
    """The capture path without a GPU: warm-up and capture on scratch rows only (the live slots' caches
    untouched), the step's inputs restored after the capture, one capture per bucket, outputs read
    from the static buffer; the tokens equal the eager engine's."""
    import contextlib

    model, prompts = _nemotron()
    free = _generate(model, prompts, [-1], "off", n=1)
    eos = sorted({s.token_ids[k].item() for s, k in zip(free, (2, 5, 3, 6, 1))})
    ref = _generate(model, prompts, eos, "off")

    class Stream:
        def wait_stream(self, other):
            pass

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "Stream", Stream)
    monkeypatch.setattr(cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(cuda, "graph", lambda g, pool=None, capture_error_mode="global": contextlib.nullcontext())
    captured, runners = [], []
    capture_on_device = DecodeStepRunner._capture_on_device

    def capture(self, bucket):
        lengths, keys = self.cache.lengths.clone(), [k.clone() for k in self.cache.keys]
        capture_on_device(self, bucket)
        bucket.graph.runner, bucket.graph.bucket = self, bucket
        live = list(range(self.cache.num_slots))  # warm-up and capture touched the scratch slot only
        assert torch.equal(self.cache.lengths[live], lengths[live])
        assert all(torch.equal(k[live], k0[live]) for k, k0 in zip(self.cache.keys, keys))
        captured.append(bucket.size)

    monkeypatch.setattr(DecodeStepRunner, "_capture_on_device", capture)
    decode_runner = PolicyRolloutEngine._decode_runner

    def graphs_on_cpu(self, cache):
        runner = decode_runner(self, cache)
        runner.capture, runner.probe = True, False
        runners.append(runner)
        return runner

    monkeypatch.setattr(PolicyRolloutEngine, "_decode_runner", graphs_on_cpu)
    got = _generate(model, prompts, eos, "on")
    assert len(captured) >= 3 and len(captured) == len(set(captured)) == runners[0].captures, captured
    for a, b in zip(ref, got):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-5, rtol=0)


def test_slot_cache_and_graphs_are_kept_across_calls():
    """A second call whose slots have the same count and (rounded) length decodes on the first call's cache
    and graphs, stale keys and states of that call notwithstanding; other shapes and release_memory drop them."""
    model, prompts = _nemotron()
    params = SamplingParams(max_new_tokens=8, n=2, temperature=0.0)
    eng = PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=[-1], max_num_seqs=5, cuda_graphs="on"))
    eager = PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=[-1], max_num_seqs=5))
    first = eng.generate(prompts[:3], params)
    runner = eng._runner
    assert runner is not None and runner.cache.max_len == 64
    for batch in (prompts[2:], prompts[1:4]):  # other prompts, same slot shape
        got, ref = eng.generate(batch, params).samples, eager.generate(batch, params).samples
        assert eng._runner is runner
        for a, b in zip(ref, got):
            assert a.token_ids.tolist() == b.token_ids.tolist()
            torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
    long = [RolloutPrompt(torch.arange(10, 80))]
    eng.generate(long, params)
    assert eng._runner is not runner and eng._runner.cache.max_len == 128
    eng.release_memory()
    assert eng._runner is None and first.samples


def test_static_steps_pass_the_shared_prompt_hint(monkeypatch):
    """With `share_prefix_reads` the static step gets the groups of its rows from the runner's buffers (each row
    pointing at its group's first row, the prompt length; rows of no group and padding rows at themselves, 0) and
    decodes the same tokens as eager steps without the hint; with it off the static step passes no hint."""
    from megatron_vlm.models.common import slot_cache

    model, prompts = _qwen()
    params = SamplingParams(max_new_tokens=6, n=3, temperature=0.0)
    ref = PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=[-1], max_num_seqs=5,
                                                          share_prefix_reads=False)).generate(prompts[:3], params).samples
    seen = []
    attend = slot_cache.kernels.decode_attention
    engines = []

    def spy(q, k, v, seqlens, **kw):
        hint = kw.get("shared_prefix")
        cache = engines[-1]._runner.cache  # the groups as they are at this step (slots are refilled later)
        seen.append(None if hint is None else (hint[0].tolist(), hint[1].tolist(), kw.get("slot_ids").tolist(),
                                               list(cache._share_group), list(cache._share_len)))
        return attend(q, k, v, seqlens, **kw)

    monkeypatch.setattr(slot_cache.kernels, "decode_attention", spy)
    for reads in (True, False):
        seen.clear()
        eng = PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=[-1], max_num_seqs=5, cuda_graphs="on",
                                                              share_prefix_reads=reads))
        engines.append(eng)
        got = eng.generate(prompts[:3], params).samples
        assert eng._runner is not None and eng._runner.cache.share_prefix_reads is reads
        for a, b in zip(ref, got):
            assert a.token_ids.tolist() == b.token_ids.tolist()
            torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
        if not reads:
            assert seen and all(h is None for h in seen)
            continue
        assert seen and all(h is not None for h in seen)
        cache = eng._runner.cache
        grouped = 0
        for rows, lens, slots, group, plen in seen:
            for b, (r, n, s) in enumerate(zip(rows, lens, slots)):
                if s == cache.scratch_slot or n == 0:
                    assert r == b and n == 0
                    continue
                grouped += 1
                # the root is the first row of the same prompt's group, and holds the same prompt length
                assert r <= b and group[slots[r]] == group[s] >= 0 and rows[r] == r
                assert n == plen[s] and lens[r] == n
        assert grouped > 0



def test_shared_prompt_hint_of_padding_rows_after_early_finishes():
    """Sampled completions of a group finish at different steps and leave their bucket rows to padding: those rows
    point at themselves again (on the CPU the bucket's hint buffer was its own-rows template, so a padding row kept
    a group root of an earlier step with length 0 and the kernel refused the step: "row 15 shares the prefix of row
    12"), and the static steps sample what eager steps without the hint do."""
    model, prompts = _qwen()
    free = _generate(model, prompts, [-1], "off", n=1)
    eos = [min(t for s in free for t in s.token_ids[:4].tolist())]
    params = SamplingParams(max_new_tokens=8, n=4, temperature=1.0)
    out = {}
    for mode, reads in (("off", False), ("on", True)):
        eng = PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=eos, max_num_seqs=16, cuda_graphs=mode,
                                                              share_prefix_reads=reads))
        out[mode] = eng.generate(prompts, params, generator=torch.Generator().manual_seed(1)).samples
    assert len({len(s.token_ids) for s in out["off"]}) > 1  # early finishes happened
    for a, b in zip(out["off"], out["on"]):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-5, rtol=0)


def test_a_weight_push_while_the_kept_runner_is_replaced():
    """Asynchronous GRPO's rollout rank: the weights thread's `load_weights` (under the step lock) tells the kept
    runner its weights changed, while the generating thread's next call may replace that runner (`_kept_runner`,
    outside the lock: a new slot length). load_weights read `self._runner` twice, so a switch between the reads
    (emulated: the runner dropped right after the first) called `weights_loaded` on None and the rank failed."""
    model, prompts = _nemotron()

    class Switching(PolicyRolloutEngine):
        """The generating thread drops the kept runner right after the weights thread's first read of it."""
        drop_after_read = False

        @property
        def _runner(self):
            runner = self.__dict__.get("_kept")
            if self.drop_after_read:
                self.__dict__["_kept"] = None
            return runner

        @_runner.setter
        def _runner(self, value):
            self.__dict__["_kept"] = value

    eng = Switching(model, Tok(), EngineOptions(eos_token_ids=[-1], max_num_seqs=5, cuda_graphs="on"))
    eng.generate(prompts[:2], SamplingParams(max_new_tokens=2, n=2, temperature=0.0))
    assert eng.__dict__.get("_kept") is not None
    eng.drop_after_read = True
    eng.load_weights(None, version=3)
    assert eng.policy_version == 3
