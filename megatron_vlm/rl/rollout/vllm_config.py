"""`[rl.vllm]`: the settings of the vLLM rollout engine (`[rl] rollout_backend = "vllm"`).

Why a module of its own: the strict config loader reads it (torch-free, like rl/config.py), and the
same checks run in `--check` and at engine construction. The keys are vLLM's own `LLM(...)` arguments
where one exists, so a user coming from verl / TRL / OpenRLHF finds the names they know.

Which checks live where: `validate()` holds what the TOML alone decides (ranges, combinations);
`device_blocker()` what needs the device (sleep mode needs CUDA); `check_backend()` the `[rl]` keys
that only mean something with one of the two back ends (`allocation`'s engine prefix, the built-in
engine's own keys).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["VLLMConfig", "ROLLOUT_BACKENDS", "check_backend"]

ROLLOUT_BACKENDS = ("builtin", "vllm")


@dataclass(kw_only=True)
class VLLMConfig:
    tensor_parallel_size: int = 1
    """Tensor-parallel size of each rollout engine. The engine runs in-process on every generating rank
    with one worker, so only 1 is supported (a larger value exits 2); scale rollout with more ranks."""
    gpu_memory_utilization: float = 0.5
    """Fraction of the device memory vLLM may take for weights + KV cache (CUDA only; in (0, 1]).
    Colocated with training (synchronous GRPO): leave room for the trainer. On the CPU the KV cache is
    sized by `cpu_kv_cache_gib` instead and this key is not read."""
    cpu_kv_cache_gib: float = 1.0
    """CPU builds of vLLM: KV-cache size in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE, an integer >= 1 there:
    rounded up). Not read on CUDA."""
    enforce_eager: bool = False
    """Run the model eagerly (no torch.compile / CUDA graphs): slower decoding, faster start. The CPU
    build always gets eager mode here (its compile step takes minutes on small machines)."""
    max_num_seqs: int = 256
    """Sequences decoded together (vLLM's batch limit)."""
    max_model_len: Optional[int] = None
    """Prompt + completion tokens the engine accepts; unset = data.max_tokens_per_pack."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (the n = group_size samples of one prompt share it).
    Reset after every weight push."""
    sleep_mode: bool = False
    """Put the engine to sleep (vLLM's sleep mode) while the trainer runs, giving its device memory back;
    needs CUDA (exits 2 on other devices)."""
    sleep_level: int = 1
    """Sleep level with sleep_mode: 1 = offload the weights to host memory and drop the KV cache,
    2 = drop both (the next weight push refills them). 1 or 2."""
    weight_bucket_mb: int = 256
    """Weight push: tensors are sent to the engine in buckets of at most this many MiB (a tensor larger
    than that is a bucket of its own), gathered from the trainer's shards one bucket at a time."""

    def validate(self) -> None:
        if self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size: {self.tensor_parallel_size}: the in-process engine runs one worker "
                             "per generating rank; only 1 is supported (use more ranks for more rollout throughput)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"cpu_kv_cache_gib: must be > 0, got {self.cpu_kv_cache_gib}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2 (or unset), got {self.max_model_len}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"sleep_level: must be 1 or 2, got {self.sleep_level}")
        if self.sleep_level != 1 and not self.sleep_mode:
            raise ValueError("sleep_level: only read with sleep_mode = true; set sleep_mode or leave sleep_level unset")
        if self.weight_bucket_mb < 1:
            raise ValueError(f"weight_bucket_mb: must be >= 1, got {self.weight_bucket_mb}")

    def device_blocker(self, device_type: str) -> Optional[str]:
        """Why this config cannot run on a `device_type` device, naming the key; None when it can."""
        if self.sleep_mode and device_type != "cuda":
            return f"rl.vllm.sleep_mode: vLLM's sleep mode needs CUDA (this job runs on {device_type}); set it to false"
        return None


def check_backend(rl) -> None:
    """The `[rl]` keys that depend on `rollout_backend` (ValueError naming the key)."""
    from megatron_vlm.rl.async_allocation import parse_allocation

    if rl.rollout_backend not in ROLLOUT_BACKENDS:
        raise ValueError(f"rollout_backend: must be one of {list(ROLLOUT_BACKENDS)}, got {rl.rollout_backend!r}")
    if rl.allocation is not None:
        engine = parse_allocation(rl.allocation).engine
        if engine is not None and engine != "vllm":
            raise ValueError(f"allocation: {rl.allocation!r}: the {engine!r} back end is not supported; the rollout ranks "
                             f"run the built-in engine or vLLM (rollout_backend = 'vllm' with 'vllm:dN+dM')")
        if engine == "vllm" and rl.rollout_backend != "vllm":
            raise ValueError(f"allocation: {rl.allocation!r} puts the rollout ranks on vLLM but rollout_backend = "
                             f"{rl.rollout_backend!r}; set rollout_backend = 'vllm' or write 'rollout:N+train:M'")
    if rl.rollout_backend == "vllm" and rl.allocation is not None:
        raise ValueError(f"allocation: {rl.allocation!r} with rollout_backend = 'vllm': the asynchronous loop's rollout "
                         "ranks run the built-in engine only so far; use the synchronous loop (no allocation) with vLLM")
    if rl.rollout_backend != "vllm":
        if rl.vllm != VLLMConfig():
            raise ValueError("vllm: the [rl.vllm] section is only read with rollout_backend = 'vllm'")
        return
    builtin_only = {"rollout_weights": "shared", "rollout_cuda_graphs": "off", "kv_block_size": 0, "kv_cache_blocks": 0,
                    "rollout_batch_prompts": 0, "rollout_memory_gib": 0.0}
    for key, default in builtin_only.items():
        if getattr(rl, key, default) != default:
            raise ValueError(f"{key}: a setting of the built-in engine; with rollout_backend = 'vllm' size the engine "
                             "in [rl.vllm] (max_num_seqs, cpu_kv_cache_gib / gpu_memory_utilization)")
    rl.vllm.validate()
