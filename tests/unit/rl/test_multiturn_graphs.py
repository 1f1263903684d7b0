"""Multi-turn rollouts in static decode steps (`rl.rollout.cuda_graphs`: the CUDA-graph form, run eagerly on the
CPU with its graph-safety probe) equal the eager steps: the same trajectories (tokens, model mask, finish reasons),
behaviour log-probs within 1e-5 and, for a MoE model, the same recorded routes; conversations at different turns
share the steps (replies appended between them) and the steps cross bucket sizes. The paged KV cache is refused
there (a conversation keeps its slot across turns)."""
import pytest
import torch
from multiturn_helpers import rollout, vqa_file

from megatron_vlm.errors import ConfigError
from megatron_vlm.inference.decode_graphs import DecodeStepRunner
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


def test_paged_cache_is_refused(tmp_path):
    from megatron_vlm.checkpoint.hf import load_hf_model
    from megatron_vlm.testing.synthesize import synthesize_model_folder

    model = load_hf_model(str(synthesize_model_folder("tiny_qwen2_5_vl", tmp_path / "m", seed=0))).eval()
    engine = PolicyRolloutEngine(model, None, EngineOptions(eos_token_ids=[1], pad_token_id=0, kv_block_size=4))
    with pytest.raises(ConfigError, match="rl.rollout.kv_block_size"):
        MultiTurnRollout(engine)
