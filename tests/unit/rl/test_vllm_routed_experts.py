"""Why routing replay refuses the vLLM back end (exit 2 naming rl.routing_replay), measured on the vLLM build this
project tests with (marker `vllm`: run by .ci/vllm_tests.sh in the vLLM environment).

vLLM 0.32 returns the experts of every token (`CompletionOutput.routed_experts`) only with
`enable_return_routed_experts`, which needs its model runner V2, which needs Triton with a CPU backend; the CPU
build has none, so asking for the routes fails when the engine's config is built. This test builds that config
for a tiny Qwen3-MoE folder and expects exactly that refusal: when it fails (a vLLM whose CPU build returns the
routes), the routes can be fed to the replay path (`RolloutSample.routes`) and tested here, and the refusal lifted.
"""
import importlib.util

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vllm is not installed here (run these tests in the vLLM environment: docs/vllm.md, "
                                                          "'Running the vLLM tests')")]

from megatron_vlm.testing.synthesize import synthesize_model_folder  # noqa: E402


def test_cpu_build_returns_no_routed_experts(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm.envs
    from vllm.engine.arg_utils import EngineArgs

    # an engine that ran earlier in this process (an in-process job test) froze vLLM's environment variables in its
    # cache: this test changes VLLM_USE_V2_MODEL_RUNNER below, which the cache would hide
    vllm.envs.disable_envs_cache()

    folder = synthesize_model_folder("tiny_qwen3_moe", tmp_path / "moe", seed=0)
    base = dict(model=str(folder), dtype="float32", max_model_len=256, enforce_eager=True, distributed_executor_backend="uni",
                enable_chunked_prefill=False, max_num_batched_tokens=8192)
    EngineArgs(**base).create_engine_config()  # the folder itself is fine for this vLLM
    with pytest.raises(Exception, match="Model Runner V2"):
        EngineArgs(**base, enable_return_routed_experts=True).create_engine_config()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(Exception, match="requires Triton"):
        EngineArgs(**base, enable_return_routed_experts=True).create_engine_config()
