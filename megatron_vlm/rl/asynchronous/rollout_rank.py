"""The rollout ranks of asynchronous GRPO: generate, score and hand over groups without waiting for
training (but never further ahead than `rl.asynchronous.max_head_offpolicyness` allows).

Why its own loop: a rollout rank holds no optimizer and runs no training collective; it only needs the
prompt stream, an inference copy of the policy, the reward workers and the bridge to training rank 0
(rl/asynchronous/bridge.py). Three threads per rollout rank:

- generation (the caller's thread): for steps b = start, start + 1, ... (the prompts of step b are the
  synchronous loop's: `prompt_batches(seed, b)`, rollout rank r taking prompts r, r + N, ...; the
  sampling generator is `sampling_generator(seed, b, r)`), wait until the engine holds version
  >= b - max_head_offpolicyness (the staleness gate: every token of step b's samples is then drawn by
  a version the trainer at step b accepts), then `engine.generate` the rank's prompts (continuous
  batching; the weights may change between two tokens);
- weights: receives the trainer's control messages; a weight push is written into the model with
  decoding paused at a token boundary (rl/asynchronous/weights.py), then the version moves; "stop" ends the
  rank;
- scoring: scores each finished step in the reward worker pool while the next step generates, then
  sends the step's groups to the trainer once the trainer has asked for that step (a "want"
  message, sent as soon as the trainer holds step b - 1's groups), so no message is ever left without a
  receiver; a "want" still open when the rank stops is answered with a "stopped" payload, so the
  trainer's receive of it ends too.

Exit: the trainer's "stop" message (end of the run, or a SIGTERM stop: then 143 like every rank). A resume the
trainer refuses (a checkpoint past `train.max_steps`, another prompt order) comes as "refused" in place of the start
message: the rank exits 2 with the trainer's line before it loads anything. A SIGTERM that
reaches only a rollout rank goes to the trainer with that rank's next step (`signum`): the trainer then stops the job
at its step boundary with a checkpoint, as for a SIGTERM of its own. A
trainer that dies makes the weight thread's receive fail: the rank logs the error and exits 1. A scoring
error ends the rank at once with that error (its weight thread is not waited for: the trainer, waiting for
this rank's samples, sends nothing more); the closed bridge then fails the trainer's receive. Steps
generated but not yet trained when the trainer stops are dropped; a resumed run generates them again.

A stop signal (this rank's) or the trainer's "stop" while a reward batch or an environment turn hangs, or while the
step generates (the engine asks the check between its decode / engine steps, the built-in and the vLLM engine alike):
the wait or the generation is given up once it has gone on `ABANDON_GRACE_S` since (`WaitAbandoned`, rewards/pool.py)
and that step is answered, once the trainer asks for it, with a "stopped" payload carrying the signal, so that the
trainer abandons it and stops the job at once instead of after `rl.reward_pool.batch_timeout_s` or the whole rollout
(rl/asynchronous/trainer.py). (The trainer's "stop" also interrupts a generation at once: `engine.interrupt()`.)
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import torch

from megatron_vlm.abandon import WaitAbandoned
from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.media import MediaLimits
from megatron_vlm.data.processor import load_processor
from megatron_vlm.errors import ConfigError
from megatron_vlm.inference.engine import SamplingParams
from megatron_vlm.inference.generators import sampling_generator
from megatron_vlm.inference.kv_budget import kv_bytes_per_slot, rollout_prompts_for_budget
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
from megatron_vlm.models.common.parallel_plan import copy_input_casts
from megatron_vlm.parallel.collectives import barrier
from megatron_vlm.parallel.precision import compute_dtype, mixed_param_dtype
from megatron_vlm.rl.asynchronous.bridge import Role
from megatron_vlm.rl.asynchronous.prompt_check import prompt_digest
from megatron_vlm.rl.asynchronous.weights import receive_weights
from megatron_vlm.rl.prompts.dataset import prompt_batches
from megatron_vlm.rl.prompts.encoder import PromptEncoder
from megatron_vlm.rl.prompts.lengths import drop_unusable_prompts
from megatron_vlm.rl.prompts.sets import load_prompt_sets
from megatron_vlm.rl.rewards.manager import RewardManager
from megatron_vlm.rl.trainer import paged_kv_kwargs, require_rl
from megatron_vlm.training.context import RunContext

__all__ = ["run_rollout_rank", "EXIT_STOPPED"]

log = logging.getLogger("megatron_vlm")

EXIT_STOPPED = 143


class _State:
    """What the three threads share."""

    def __init__(self, version: int):
        self.cond = threading.Condition()
        self.version = version
        self.wanted = -1
        """The step the trainer waits for (its "want" message): a step is sent only then, so no message
        is ever left without a receiver (a trainer stopped by SIGTERM asks for nothing more)."""
        self.sent = -1
        """The last step whose payload went to the trainer."""
        self.stop = False
        self.error: Optional[BaseException] = None
        self.engine: Any = None  # PolicyRolloutEngine or VLLMRolloutEngine
        self.signum: Callable[[], int] = lambda: 0
        """The stop signal this rank received (its `StopFlag`): sent with each step, so the trainer stops too."""
        self.abandon: Optional[Callable[[], bool]] = None
        """The reward / environment waits' stop check (None: never give up)."""
        self.stop_signum = 0
        """The signal of the trainer's "stop" (0: the run ended): the rank then exits 143 like every rank."""


def _sample_payload(s, digests: list[str]) -> dict:
    """One sample for the trainer; `digests`: the step's prompts' (`prompt_digest`), which the trainer checks its own
    encoding of the prompt against."""
    return {"prompt_index": s.prompt_index, "sample_index": s.sample_index, "token_ids": s.token_ids,
            "logprobs": s.logprobs, "token_versions": s.token_versions, "text": s.text,
            "finish_reason": s.finish_reason, "prompt_length": s.prompt_length, "routes": s.routes,
            "prompt_digest": digests[s.prompt_index]}


def run_rollout_rank(ctx: RunContext, role: Role) -> int:
    cfg, rl, env = ctx.cfg, require_rl(ctx.cfg), ctx.env
    bridge = role.bridge
    if bridge is None:
        raise RuntimeError("asynchronous GRPO: a rollout rank without its bridge to the trainer")
    hello = bridge.broadcast_object()  # the trainer has built its prompt sets and loaded its checkpoint
    if hello.get("kind") == "refused":  # the trainer refused its resume point (exit 2 there): the same line, nothing loaded
        raise ConfigError(str(hello["error"]))
    start, total = int(hello["start_step"]), int(hello["total_steps"])
    dtype = compute_dtype(cfg.train.precision, getattr(torch, cfg.model.dtype), env.device)
    # the trainer's processor (training/model_bundle.py), video limits included: the same prompts, the same tokens
    processor = load_processor(cfg.model.path, min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels,
                               video_min_pixels=cfg.data.video_min_pixels, video_max_pixels=cfg.data.video_max_pixels,
                               chat_template_kwargs=cfg.data.chat_template_kwargs)
    bad = BadRecordLog()
    sets = load_prompt_sets(cfg.data, rl, run_dir=ctx.run_dir, is_main=False, barrier=barrier, bad_records=bad)
    sets = drop_unusable_prompts(sets, processor, cfg.data, rl, bad)  # the trainer's filter: the same prompts
    if len(sets.train) != hello["num_prompts"]:
        raise RuntimeError(f"asynchronous GRPO: this rollout rank reads {len(sets.train)} training prompts, the trainer "
                           f"{hello['num_prompts']}")
    # the prompts skipped mid-run go to the trainer with each step's samples (its log is the run's, saved in its checkpoints)
    skips = BadRecordLog()
    # the trainer's budget (rl/trainer.py): it encodes the prompts of every group again, and must accept the same ones
    budget = max(rl.rollout.max_new_tokens, getattr(getattr(rl, "eval", None), "max_new_tokens", 0) or 0)
    encoder = PromptEncoder(processor, max_frames=cfg.data.max_frames, fps=cfg.data.fps, max_new_tokens=budget,
                            max_tokens=cfg.data.max_tokens_per_pack, limits=MediaLimits.from_config(cfg.data), bad_records=skips)
    model = load_hf_model(cfg.model.path, dtype=dtype, device=env.device).eval()
    model.requires_grad_(False)
    copy_input_casts(model, mixed_param_dtype(cfg.train.precision, env.device))  # the trainer's forward, bit for bit
    engine: Any
    if rl.rollout_backend == "vllm":  # `vllm:dN+dM`: the pushes land in `model`, which feeds the vLLM engine
        engine = _vllm_engine(ctx, processor, model, dtype)
    else:
        per_batch = rl.rollout.batch_prompts or rollout_prompts_for_budget(
            rl.rollout.memory_gib, kv_bytes_per_slot(model, torch.finfo(dtype).bits // 8), rl.batch.group_size,
            cfg.data.max_tokens_per_pack)
        # CudaGraphsConfigError (exit 2): "on" with a decode step that cannot be captured (a paged cache);
        # PagedKVConfigError (exit 2): rl.rollout.kv_block_size with a Mamba2 hybrid decoder
        engine = PolicyRolloutEngine(model, processor.tokenizer,
                                     EngineOptions(cache_dtype=dtype, device=env.device,
                                                   max_num_seqs=per_batch * rl.batch.group_size,
                                                   cuda_graphs=rl.rollout.cuda_graphs, record_routes=True,
                                                   **paged_kv_kwargs(rl)))
    multiturn = None
    if rl.env is not None:  # [rl.env]: conversations with environments in this rank's worker pool (rl/env/rollout.py)
        from megatron_vlm.rl.env.rollout import MultiTurnRounds

        multiturn = MultiTurnRounds.from_config(rl, cfg.data.max_tokens_per_pack, engine, processor, data=cfg.data)
        encoder = multiturn.prompt_encoder(encoder)  # the tools in the system turn, as on the trainer
    receive_weights(model, bridge, bridge.broadcast_object(), engine)  # the trainer's weights at `start`
    manager = RewardManager(rl.rewards, timeout_s=rl.reward_pool.timeout_s, num_workers=rl.reward_pool.workers,
                            memory_limit_mb=rl.reward_pool.memory_limit_mb, batch_timeout_s=rl.reward_pool.batch_timeout_s,
                            value_limit=rl.reward_pool.abs_max)
    state = _State(engine.policy_version)
    state.engine = engine
    state.signum = lambda: int(ctx.stop.signum)
    state.abandon = lambda: state.stop or ctx.stop.pending()
    todo: queue.Queue = queue.Queue()
    threads = [threading.Thread(target=_weights_loop, args=(state, bridge, model, engine), daemon=True, name="weights"),
               threading.Thread(target=_score_loop, args=(state, bridge, todo, manager, sets.train), daemon=True,
                                name="scoring")]
    for t in threads:
        t.start()
    try:
        _generate_loop(ctx, role, state, engine, encoder, sets.train, todo, start, total, multiturn, skips)
        todo.put(None)
        threads[1].join()
        if state.error is None:  # the weight thread ends at the trainer's "stop"; after an error of this rank
            threads[0].join()    # the trainer waits for its samples instead: raise now, the closed bridge tells it
    finally:
        manager.close()
        if multiturn is not None:
            multiturn.close()
        if hasattr(engine, "close"):
            engine.close()
    if state.error is not None:
        log.error("rollout rank %d: %s", role.rank, state.error)
        raise state.error
    return EXIT_STOPPED if ctx.stop.signum or state.stop_signum else 0


def _vllm_engine(ctx, processor, model, dtype):
    """The rollout rank's vLLM engine (`rl.allocation = "vllm:dN+dM"`, docs/vllm.md): loaded from model.path;
    every push of the trainer goes into `model` (rl/asynchronous/weights.py), then from it into the engine
    with generation paused at an engine step (`VLLMRolloutEngine.paused`)."""
    from megatron_vlm.inference.policy_engine import vision_token_ids
    from megatron_vlm.inference.stopping import eos_token_ids_of
    from megatron_vlm.inference.vllm_engine import VLLMRolloutEngine

    cfg = ctx.cfg
    placeholders = [getattr(processor, k, None) for k in ("image_token_id", "video_token_id")]
    return VLLMRolloutEngine(cfg.model.path, cfg.rl.vllm, dtype=dtype, device=ctx.env.device,
                             max_model_len=cfg.data.max_tokens_per_pack, seed=cfg.train.seed, sync_from=model,
                             eos_token_ids=sorted(eos_token_ids_of(processor.tokenizer, getattr(model, "hf_generation_config", None))),
                             placeholder_ids=[p for p in placeholders if p is not None],
                             suppress_token_ids=vision_token_ids(model))


def _generate_loop(ctx, role: Role, state: _State, engine, encoder, train_set, todo, start: int, total: int,
                   multiturn: Any = None, skips: Optional[BadRecordLog] = None) -> None:
    """Generate steps start .. total - 1 (module docstring); `skips`: the encoder's log, emptied into each step's item."""
    rl, seed, device = ctx.cfg.rl, ctx.cfg.train.seed, ctx.env.device
    n_rollout, k = role.allocation.rollout, rl.asynchronous.max_head_offpolicyness
    params = SamplingParams(max_new_tokens=rl.rollout.max_new_tokens, n=rl.batch.group_size, temperature=rl.rollout.temperature,
                            top_p=rl.rollout.top_p, top_k=rl.rollout.top_k, stop=tuple(rl.rollout.stop))
    batches = prompt_batches(len(train_set), rl.batch.prompts_per_step, seed=seed, start_step=start)
    for b in range(start, total):
        batch = next(batches)
        t_wait = time.perf_counter()
        with state.cond:  # the staleness gate
            state.cond.wait_for(lambda: state.stop or state.version >= b - k)
            if state.stop:
                return
        idle = time.perf_counter() - t_wait
        t0 = time.perf_counter()
        indices, prompts = [], []
        for i in batch[role.rank::n_rollout]:
            e = encoder.encode(train_set[i])
            if e is not None:
                indices.append(i)
                prompts.append(e)
        trajs, result = None, None
        # the engine's stop check between its steps (the engine may take none: a stand-in)
        wait = {"abandon": state.abandon} if state.abandon is not None and getattr(engine, "takes_abandon", False) else {}
        try:
            if prompts and multiturn is not None:  # the synchronous loop's seed for (step, rank): k = 0 repeats it
                from megatron_vlm.rl.asynchronous.multiturn import generate_trajectories

                result, trajs = generate_trajectories(multiturn, [train_set[i] for i in indices], prompts, params, seed,
                                                      b, role.rank, abandon=state.abandon)
            elif prompts:
                result = engine.generate(prompts, params, generator=sampling_generator(seed, b, role.rank, device), **wait)
        except WaitAbandoned as e:  # a hung environment turn or a generation given up: stopping
            log.warning("rollout rank %d: stopping: step %d's %s given up", role.rank, b,
                        "environment turn" if e.waited_for == "environments" else e.waited_for)
            todo.put({"step": b, "stopped": True})  # the scoring thread answers step b with "stopped" once it is asked
            return
        if state.stop:
            return
        item = {"step": b, "indices": indices, "result": result, "idle_s": idle, "trajectories": trajs,
                "digests": [prompt_digest(p.input_ids) for p in prompts],
                "busy_s": time.perf_counter() - t0, "skipped": encoder.skipped,
                "bad_records": skips.take() if skips is not None else []}
        if getattr(engine, "kv_block_size", 0):  # samples preempted for lack of KV blocks (the on-demand paged pool)
            item["preemptions"] = float(result.stats.get("preemptions", 0.0)) if result is not None else 0.0
        todo.put(item)


def _weights_loop(state: _State, bridge, model, engine) -> None:
    try:
        while True:
            msg = bridge.broadcast_object()
            if msg["kind"] == "stop":
                state.stop_signum = int(msg.get("signum", 0))
                break
            if msg["kind"] == "want":
                with state.cond:
                    state.wanted = int(msg["step"])
                    state.cond.notify_all()
                continue
            receive_weights(model, bridge, msg, engine)
            with state.cond:
                state.version = int(msg["version"])
                state.cond.notify_all()
    except BaseException as e:  # noqa: BLE001 - handed to the main thread
        state.error = e
    with state.cond:
        state.stop = True
        state.cond.notify_all()
    engine.interrupt()


def _score_loop(state: _State, bridge, todo, manager, train_set) -> None:
    try:
        _score_items(state, bridge, todo, manager, train_set)
        with state.cond:
            owed = state.wanted if state.wanted > state.sent and state.error is None else None
        if owed is not None:  # the trainer waits for a step this rank will not generate: release it
            bridge.send_object({"step": owed, "stopped": True, "signum": int(state.signum())})
    except BaseException as e:  # noqa: BLE001 - handed to the main thread
        state.error = e
        with state.cond:
            state.stop = True
            state.cond.notify_all()
        if state.engine is not None:
            state.engine.interrupt()


def _score_items(state: _State, bridge, todo, manager, train_set) -> None:
    """Score and send finished steps until the generation loop ends (None) or the rank stops."""
    while True:
        item = todo.get()
        if item is None:
            return
        b = item["step"]
        if item.get("stopped"):  # step b's generation was given up: the rank is stopping
            _answer_stopped(state, bridge, b)
            return
        result = item["result"]
        samples = result.samples if result is not None else []
        owners = [train_set[item["indices"][s.prompt_index]] for s in samples]
        t0 = time.perf_counter()
        wait = {"abandon": state.abandon} if state.abandon is not None else {}
        try:
            scored = manager.score([s.text for s in samples], [p.answer for p in owners], prompts=[p.problem for p in owners],
                                   metadata=[p.metadata for p in owners], **wait) if samples else None
        except WaitAbandoned:  # the rank is stopping: the trainer, once it asks for step b, is told so
            log.warning("rollout rank: stopping: step %d's reward batch given up", b)
            _answer_stopped(state, bridge, b)
            return
        payload = {"step": b, "indices": item["indices"], "samples": [_sample_payload(s, item["digests"]) for s in samples],
                   "total": scored.total if scored else [], "per_reward": scored.per_reward if scored else {},
                   "reward_s": time.perf_counter() - t0, "idle_s": item["idle_s"], "busy_s": item["busy_s"],
                   "gen_s": result.seconds if result is not None else 0.0, "skipped": item["skipped"],
                   "bad_records": item.get("bad_records", []),
                   "reward_fail": manager.metrics(), "reward_last_error": getattr(manager, "last_error", "")}
        if "preemptions" in item:
            payload["preemptions"] = item["preemptions"]
        if item.get("trajectories") is not None:  # [rl.env]: + the environment's turn rewards, the trajectories
            from megatron_vlm.rl.asynchronous.multiturn import add_trajectories

            add_trajectories(payload, item["trajectories"])
        with state.cond:  # send step b once the trainer waits for it
            state.cond.wait_for(lambda: state.stop or state.wanted >= b)
            if state.stop:
                return
        # a SIGTERM that reached only this rank (its node preempted): the trainer's stop check reduces over the
        # training ranks alone, so it learns of it here, saves at its step boundary and stops the job
        payload["signum"] = int(state.signum())
        bridge.send_object(payload)
        with state.cond:
            state.sent = b


def _answer_stopped(state: _State, bridge, b: int) -> None:
    """Step b was given up because the rank is stopping: once the trainer asks for it (no message is sent without a
    receiver), answer "stopped" with this rank's signal, so that the trainer abandons the step; nothing when the
    trainer's "stop" comes first (`_score_loop` then answers a step still owed)."""
    with state.cond:
        state.cond.wait_for(lambda: state.stop or state.wanted >= b)
        if state.stop:
            return
    bridge.send_object({"step": b, "stopped": True, "signum": int(state.signum())})
    with state.cond:
        state.sent = b
