"""RL unit tests: tiny tensors run fastest single-threaded (on a loaded 2-core machine, intra-op
threads of tiny matmuls mostly wait for each other: ~5x slower), so every test here runs with one
torch thread; the previous setting is restored afterwards."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def proc(tmp_path_factory):
    """A tiny Qwen2.5-VL processor, built once per module (prompt-set tests)."""
    from megatron_vlm.testing.tiny_processor import build_tiny_qwen2_5_vl_processor

    return build_tiny_qwen2_5_vl_processor(tmp_path_factory.mktemp("proc"))


@pytest.fixture(scope="session")
def tiny_vlm_folder(tmp_path_factory):
    """A tiny Qwen2.5-VL model folder (config, random weights, tokenizer, processor), built once per session
    (the reward-model and judge tests)."""
    from megatron_vlm.testing.tiny_model import build_tiny_model_folder

    return build_tiny_model_folder("tiny_qwen2_5_vl", tmp_path_factory.mktemp("tiny_vlm") / "vl", seed=3)
