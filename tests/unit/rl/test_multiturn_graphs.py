"""Multi-turn rollouts in static decode steps (`rl.rollout.cuda_graphs`: the CUDA-graph form, run eagerly on the
CPU with its graph-safety probe) equal the eager steps: the same trajectories (tokens, model mask, finish reasons),
behaviour log-probs within 1e-5 and, for a MoE model, the same recorded routes; conversations at different turns
share the steps (replies appended between them) and the steps cross bucket sizes. The paged KV cache is refused
there (a conversation keeps its slot across turns)."""
import pytest
import torch
from multiturn_helpers import rollout, vqa_file

from megatron_vlm.errors import ConfigError
from megatron_vlm.inference.decode_graphs import DecodeStepRunner, GraphUnsafeError
from megatron_vlm.inference.multiturn import MultiTurnRollout
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine


@pytest.fixture(scope="module")
def vqa(tmp_path_factory):
    return vqa_file(tmp_path_factory.mktemp("vqa"))


@pytest.mark.parametrize("kind", ["tiny_qwen2_5_vl", "tiny_qwen3_vl_moe"])
def test_static_steps_equal_eager_steps(kind, vqa, tmp_path, monkeypatch):
    moe = kind.endswith("moe")
    _, _, ref, _ = rollout(kind, vqa, tmp_path / "eager", record_routes=moe)
    rows: list[int] = []
    step = DecodeStepRunner.step

    def spy(self, slots, input_ids):
        rows.append(len(slots))
        return step(self, slots, input_ids)

    monkeypatch.setattr(DecodeStepRunner, "step", spy)
    _, _, got, session = rollout(kind, vqa, tmp_path / "static", record_routes=moe, cuda_graphs="on")
    assert rows and len(set(rows)) > 1 and session.engine.cuda_graphs == "on"
    assert session.engine_stats["append_forwards"] > 0  # replies appended between static steps
    assert len(got) == len(ref)
    for a, b in zip(ref, got):
        assert b.token_ids.tolist() == a.token_ids.tolist() and b.finish_reason == a.finish_reason
        assert torch.equal(b.model_mask, a.model_mask)
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
        if moe:
            assert torch.equal(b.routes, a.routes)


def test_replayed_graphs_keep_each_steps_routes(vqa, tmp_path, monkeypatch):
    """With captured graphs (emulated: tests/fixtures/fake_cuda_graphs.py, whose replays run no Python) a step's
    routes are the graph's static output, rewritten by the next replay: each conversation keeps its own copy, so
    the recorded routes equal the eager steps' as the tokens do."""
    from tests.fixtures.fake_cuda_graphs import fake_cuda_graphs

    kind = "tiny_qwen3_vl_moe"
    _, _, ref, _ = rollout(kind, vqa, tmp_path / "eager", record_routes=True)
    runners = fake_cuda_graphs(monkeypatch)
    _, _, got, _ = rollout(kind, vqa, tmp_path / "graphs", record_routes=True, cuda_graphs="on")
    assert runners and any(b.graph.replays > 1 for r in runners for b in r.buckets.values())
    for a, b in zip(ref, got, strict=True):
        assert b.token_ids.tolist() == a.token_ids.tolist()
        assert torch.equal(b.routes, a.routes)


def test_paged_cache_is_refused(tmp_path):
    from megatron_vlm.checkpoint.hf import load_hf_model
    from megatron_vlm.testing.synthesize import synthesize_model_folder

    model = load_hf_model(str(synthesize_model_folder("tiny_qwen2_5_vl", tmp_path / "m", seed=0))).eval()
    engine = PolicyRolloutEngine(model, None, EngineOptions(eos_token_ids=[1], pad_token_id=0, kv_block_size=4))
    with pytest.raises(ConfigError, match="rl.rollout.kv_block_size"):
        MultiTurnRollout(engine)


def test_auto_fallback_and_a_failed_call_keep_no_runner(vqa, tmp_path, monkeypatch):
    """The engine's kept runner (its slot cache of slots x max_total_tokens) is dropped when "auto" gives up on graphs
    during a multi-turn call (later calls decode eagerly on a cache of their own: the kept one would only hold the
    memory) and when a call fails half-way through a step (its cache is left mid-step: the next call's prefill
    into it would fail), as in single-turn rollouts."""
    kind = "tiny_qwen2_5_vl"
    _, _, ref, _ = rollout(kind, vqa, tmp_path / "eager")
    make = PolicyRolloutEngine._kept_runner  # the engine's, which the multi-turn loop takes its runner from

    def runner_then_auto(self, *a):  # CUDA's "auto", emulated: the first static step cannot be captured
        runner = make(self, *a)
        self.cuda_graphs = "auto"

        def fail(slots, input_ids):
            raise GraphUnsafeError("decode step could not be captured: out of memory (emulated)")

        runner.step = fail
        return runner

    monkeypatch.setattr(PolicyRolloutEngine, "_kept_runner", runner_then_auto)
    _, _, got, session = rollout(kind, vqa, tmp_path / "auto", cuda_graphs="on")
    assert session.engine.cuda_graphs == "off" and session.engine._runner is None
    assert [t.token_ids.tolist() for t in got] == [t.token_ids.tolist() for t in ref]
    monkeypatch.setattr(PolicyRolloutEngine, "_kept_runner", make)

    _, _, first, session = rollout(kind, vqa, tmp_path / "kept", cuda_graphs="on")
    engine = session.engine
    assert engine._runner is not None  # kept for the next call of the same shape
    calls = [0]
    step = DecodeStepRunner._step

    def failing_step(self, bucket):  # a step that fails inside the model (after the cache's begin_step)
        calls[0] += 1
        if calls[0] == 3:
            self.cache.begin_step(1)
            raise RuntimeError("out of memory (emulated)")
        return step(self, bucket)

    monkeypatch.setattr(DecodeStepRunner, "_step", failing_step)
    with pytest.raises(RuntimeError, match="emulated"):
        rollout(kind, vqa, tmp_path / "kept", cuda_graphs="on", engine=engine)
    monkeypatch.setattr(DecodeStepRunner, "_step", step)
    assert engine._runner is None
    _, _, again, _ = rollout(kind, vqa, tmp_path / "kept", cuda_graphs="on", engine=engine)
    assert [t.token_ids.tolist() for t in again] == [t.token_ids.tolist() for t in first]


def test_routes_survive_the_next_replay(vqa, tmp_path, monkeypatch):
    """On CUDA a step's outputs (logits, MoE routes) live in the captured graph's static buffers, rewritten by the next
    replay of its bucket; the CPU's static step returns new tensors each time, so the case is emulated here: each
    bucket's outputs copied into one buffer per bucket, the step returning views of it. The loop kept a view of the
    routes per decode step: every recorded step of a bucket then read that bucket's last routes."""
    kind = "tiny_qwen3_vl_moe"
    _, _, ref, _ = rollout(kind, vqa, tmp_path / "eager", record_routes=True)
    step = DecodeStepRunner.step
    static: dict = {}

    def replayed(self, slots, input_ids):
        logits = step(self, slots, input_ids)
        n, size = len(slots), self.bucket_for(len(slots))
        bufs = static.setdefault((id(self), size), {})
        if self.last_routes is not None:
            routes = bufs.setdefault("routes", self.last_routes.new_empty((size, *self.last_routes.shape[1:])))
            routes[:n].copy_(self.last_routes)
            self.last_routes = routes[:n]
        out = bufs.setdefault("logits", logits.new_empty((size, *logits.shape[1:])))
        out[:n].copy_(logits)
        return out[:n]

    monkeypatch.setattr(DecodeStepRunner, "step", replayed)
    _, _, got, _ = rollout(kind, vqa, tmp_path / "static", record_routes=True, cuda_graphs="on")
    assert static
    for a, b in zip(ref, got):
        assert b.token_ids.tolist() == a.token_ids.tolist()
        assert torch.equal(b.routes, a.routes)
