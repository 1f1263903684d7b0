"""The training ranks of asynchronous GRPO: the loop's step object that trains on groups completed by
the rollout ranks and pushes the new weights after every step.

Why a step object and not a loop of its own: the training loop (`training/loop.py`) already owns
resume, periodic and SIGTERM checkpoints (exit 143), held-out evaluation, metrics and the export; an
asynchronous step differs from a synchronous one only in where its samples come from and in what
happens after the update. Per step s (the trainer holds policy version s = steps done):

1. receive step s's groups (training rank 0 from every rollout rank; with M > 1 training ranks the
   groups are dealt round-robin over their data shards, the tp / cp ranks of a shard taking the same; a shard left
   without a group by prompts skipped mid-run trains on a dummy, loss x 0, as the synchronous loop's short rank): completions, behaviour log-probs, per-token versions,
   rewards, and the prompts the rollout rank could not encode (bad records: training rank 0 keeps them in the
   run's log, saved with the step's checkpoint) — the wait is the trainer's idle time. Step s + 1's groups are asked for ("want") as soon as
   step s's have arrived and received by a background thread while step s trains (`_Prefetch`), so the
   exchange (the rollout rank's scoring thread waking, pickling, the transfer) overlaps the update
   instead of adding to every step;
2. check the staleness bound on every token: s - version <= max_head_offpolicyness (an error, not a
   warning: the rollout's gate guarantees it);
3. encode the prompts of the groups (the same encoder as the rollout's; one that does not encode here although it
   did there is a skipped prompt, counted, its group left out of the step), group advantages, and the
   update of the synchronous step (`GRPOStep.train_on_rounds`: with max_head_offpolicyness > 0 the
   decoupled loss, proximal log-probs recomputed before the update);
4. push the weights (rl/asynchronous/weights.py) as version s + 1; the rollout ranks waiting for it go on.

The first push (at construction, after the checkpoint is resumed) sends the whole state dict with the
run's start step, so a resumed run's rollout continues from the checkpoint's weights; steps that were
in flight when the job stopped are generated again. `finish()` sends "stop" to the rollout ranks.

A stop signal while the trainer waits for a step's groups (a rollout rank's scoring hung: up to
`rl.reward_pool.batch_timeout_s`): a rollout rank that got the signal too gives up its hung reward or environment
wait and answers with a "stopped" payload carrying its signal; a trainer that got it and still waits
`ABANDON_GRACE_S` later sends "stop" to the rollout ranks itself, which makes them answer so. The step is then
abandoned on every training rank together (`StepAbandoned`, after the exchange of the payloads among them): the
loop saves the trainer's state before the step and exits 143; a resumed run generates the step again. With M > 1
training ranks, the others meet training rank 0 every `ABANDON_POLL_S` of its wait (one all-reduce of two integers:
whether the groups are in, and each rank's stop signal) instead of waiting in the payloads' all-gather, so a signal
that reached only one of them is training rank 0's within a poll (else nobody saw it until the wait ended).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import torch

from megatron_vlm.abandon import ABANDON_POLL_S, Patience
from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.errors import ConfigError
from megatron_vlm.inference.engine import RolloutPrompt, RolloutResult, RolloutSample
from megatron_vlm.parallel.collectives import all_gather_objects, all_reduce_max, world_size
from megatron_vlm.rl.algorithms.advantage_estimators import AdvantageSpec
from megatron_vlm.rl.asynchronous.bridge import Bridge, Role
from megatron_vlm.rl.asynchronous.multiturn import round_trajectories
from megatron_vlm.rl.asynchronous.prompt_check import check_same_prompt
from megatron_vlm.rl.asynchronous.weights import push_weights, trainable_names
from megatron_vlm.rl.grpo_step import GRPOStep
from megatron_vlm.rl.metrics import PhaseTimer
from megatron_vlm.rl.prompts.data_state import grpo_data_state_refusal
from megatron_vlm.rl.prompts.shard import EncodedShard, PromptEncoding
from megatron_vlm.rl.rewards.failure_watch import RewardsAllFailedError
from megatron_vlm.rl.rounds import Round, shape_round
from megatron_vlm.rl.trainer import GRPOLoopStep, has_moe_report
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.loop import StopAfterStep, past_the_end
from megatron_vlm.training.signals import StepAbandoned

__all__ = ["AsyncGRPOLoopStep", "StalenessError"]

log = logging.getLogger("megatron_vlm")


def _nothing_encoded(step: int, payloads: list[dict]) -> str:
    """The exit-2 line of a step none of whose prompts the rollout ranks could encode (bad data, or a model that
    cannot read it), naming the last one skipped."""
    records = [r for p in payloads for r in p.get("bad_records", ())]
    last = records[-1] if records else None
    where = (f"; the last one skipped: {last['source']}:{last['index']}: {last['category']}: {last['detail']}"
             if last else "")
    return (f"data: none of the prompts of step {step} could be encoded by the rollout ranks{where} (their warnings "
            "name more)")


def _generated_tokens(payload: dict) -> int:
    """Tokens a rollout rank generated for the step (its samples' completions, counted as the synchronous step does)."""
    return sum(int(s["token_ids"].numel()) for s in payload["samples"])


class StalenessError(RuntimeError):
    """A sample arrived with a token older than max_head_offpolicyness allows."""


class _Prefetch:
    """Training rank 0 receives one step's payloads of every rollout rank on a background thread (the
    bridge's sample group is used by this thread only; control messages and weight pushes stay on the
    main thread, in order)."""

    def __init__(self, bridge: Bridge, step: int, n_rollout: int):
        self.step = step
        self.payloads: Optional[list[dict]] = None
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(bridge, n_rollout), daemon=True, name=f"prefetch-{step}")
        self._thread.start()

    def _run(self, bridge: Bridge, n_rollout: int) -> None:
        try:
            self.payloads = [bridge.recv_object(1 + r) for r in range(n_rollout)]
        except BaseException as e:  # noqa: BLE001 - re-raised by get() on the main thread
            self.error = e

    def wait(self, timeout: float) -> bool:
        """True once the payloads (or the receive's error) are in."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def get(self) -> list[dict]:
        self._thread.join()
        if self.error is not None:
            raise self.error
        assert self.payloads is not None
        return self.payloads


class AsyncGRPOLoopStep(GRPOLoopStep):
    _stopped = False
    """"stop" was sent to the rollout ranks (at the end, or early: a stop signal while a step's groups were awaited)."""

    def __init__(self, ctx: RunContext, train_set: Any, grpo: GRPOStep, role: Role, *, model: torch.nn.Module,
                 encoder: PromptEncoding, start_step: int, total_steps: int,
                 evaluate: Optional[Callable[[int], Optional[dict]]] = None, bad_records: Optional[BadRecordLog] = None,
                 resume_data: Optional[dict] = None):
        """`start_step`: the resume point's step (0: a fresh run); `resume_data`: its checkpoint's data state (None: a
        fresh run). A resume the loop would refuse is refused here, before the start message and the weight push
        (`_refuse_resume`)."""
        super().__init__(ctx, train_set, grpo, evaluate, bad_records=bad_records)
        self.role, self.model, self.encoder = role, model, encoder
        self.advantage = AdvantageSpec.from_config(self.rl)
        self.bridge = role.bridge  # training rank 0 only
        self.k = self.rl.asynchronous.max_head_offpolicyness
        self._trainable = trainable_names(model)
        self._stopped = False
        self.total_steps = total_steps
        self._prefetch: Optional[_Prefetch] = None
        self._last_end = time.perf_counter()
        self._refuse_resume(start_step, resume_data)
        if self.bridge is not None:
            self.bridge.broadcast_object({"kind": "hello", "start_step": start_step, "total_steps": total_steps,
                                          "num_prompts": len(train_set)})
        self.push_s = push_weights(model, self.bridge, start_step)
        log.info("asynchronous GRPO: %d rollout + %d training ranks, max_head_offpolicyness %d, weights of step %d pushed "
                 "(%.2f s)", role.allocation.rollout, role.allocation.train, self.k, start_step, self.push_s)

    def _refuse_resume(self, start_step: int, resume_data: Optional[dict]) -> None:
        """ConfigError (exit 2) for a resume `run_loop` would refuse (a checkpoint past the run's steps, another prompt
        order), found before the rollout ranks load any weights: training rank 0 sends them the line in place of the
        start message ("refused"), and every rank exits 2 with it. Every training rank decides alike (the same
        checkpoint and config); `run_loop` checks the same again for a resume that passes."""
        why = past_the_end(start_step, self.total_steps) if start_step > self.total_steps else None
        if why is None and resume_data is not None:
            why = grpo_data_state_refusal(resume_data, **self._order(), data_files=self._data_files(),
                                          prompt_lengths=self._prompt_lengths())
        if not why:
            return
        if self.bridge is not None:
            self.bridge.broadcast_object({"kind": "refused", "error": why})
        raise ConfigError(why)

    # ------------------------------------------------------------------ one step
    def _receive(self, step: int) -> list[dict]:
        """Step `step`'s payloads of every rollout rank, on every training rank."""
        payloads: Optional[list[dict]] = None
        if self.bridge is not None:
            n_rollout = self.role.allocation.rollout
            pending, self._prefetch = self._prefetch, None
            if pending is None or pending.step != step:
                self.bridge.broadcast_object({"kind": "want", "step": step})
                pending = _Prefetch(self.bridge, step, n_rollout)
            payloads = self._await(pending)
            if self._stopped:  # the rollout ranks were told to stop while this step was awaited: nothing to push to;
                # with this rank's signal, so that every training rank (which may have got none) abandons the step
                signum = int(self.ctx.stop.signum)
                payloads = [{**p, "stopped": True, "signum": p.get("signum") or signum} for p in payloads]
            usable = all(p["step"] == step and not p.get("stopped") for p in payloads)
            for p in payloads if usable else ():
                if self.bad_records is not None:  # the prompts it skipped for this step: in this step's checkpoint
                    self.bad_records.extend(p.get("bad_records", ()))
            if usable and step + 1 < self.total_steps:  # ask for the next step now: it arrives while this one trains
                self.bridge.broadcast_object({"kind": "want", "step": step + 1})
                self._prefetch = _Prefetch(self.bridge, step + 1, n_rollout)
        elif self._meets_while_waiting():
            self._wait_for_rank0()
        if self.role.allocation.train > 1:
            payloads = all_gather_objects(payloads)[0]
        assert payloads is not None  # training rank 0 received them; the others got rank 0's
        self._check_received(step, payloads)
        return payloads

    def _await(self, pending: _Prefetch) -> list[dict]:
        """The awaited payloads; a stop signal pending on this rank (its own, or another training rank's: `_meet`) for
        `ABANDON_GRACE_S` of the wait sends "stop" to the rollout ranks (module docstring), whose answer then ends the
        wait."""
        give_up = Patience(lambda: self.ctx.stop.pending())
        meet = self._meets_while_waiting()
        while True:
            arrived = pending.wait(ABANDON_POLL_S)
            if meet:
                arrived = self._meet(arrived)
            if arrived:
                break
            if not self._stopped and give_up():
                log.warning("asynchronous GRPO: stop signal %d while waiting for the rollout ranks' groups: stopping "
                            "them", self.ctx.stop.signum)
                self._stop_rollout()
        return pending.get()

    def _meets_while_waiting(self) -> bool:
        """Whether the training ranks meet during the wait for a step's groups (`_meet`): with more than one."""
        return self.role.allocation.train > 1 and world_size() > 1

    def _meet(self, arrived: bool) -> bool:
        """One meeting of the training ranks while rank 0 waits for a step's groups (every ABANDON_POLL_S of the
        wait: one all-reduce of two integers; the wait is idle time, no step runs): whether rank 0 has them (`arrived`
        there), and the stop signal of any rank, taken by every rank's flag.

        Why: the other training ranks would otherwise wait in the all-gather of the payloads, a call that returns
        only once rank 0 joins it; a stop signal that reached only one of them would be seen by nobody (its handler
        runs when the call returns) until rank 0's wait ended, however long a hung rollout rank makes it. Met, rank 0
        has the signal within a poll and stops the rollout ranks as for its own."""
        arrived_all, signum = all_reduce_max([int(arrived), int(self.ctx.stop.signum)], self.ctx.device)
        if signum and not self.ctx.stop.signum:
            log.warning("asynchronous GRPO: another training rank received stop signal %d while waiting for the "
                        "rollout ranks' groups", signum)
            self.ctx.stop.signum = signum
        return bool(arrived_all)

    def _wait_for_rank0(self) -> None:
        """A training rank other than 0: meet rank 0 (`_meet`) until it has the step's groups."""
        while not self._meet(False):
            pass

    def _check_received(self, step: int, payloads: list[dict]) -> None:
        """On every training rank alike: `StepAbandoned` when a payload says its rank stopped because of a stop signal
        (its own, or this trainer's), an error for any other payload that is not this step's samples."""
        for r, p in enumerate(payloads):
            if p.get("stopped") and (p.get("signum") or self.ctx.stop.signum):
                if not self.ctx.stop.signum:  # a rollout rank's signal: the job stops as for one of its own
                    self.ctx.stop.signum = int(p["signum"])
                raise StepAbandoned(f"rollout rank {r} stopped before sending step {step + 1}'s groups "
                                    f"(signal {p.get('signum') or self.ctx.stop.signum})")
        for r, p in enumerate(payloads):
            if p["step"] != step or p.get("stopped"):
                raise RuntimeError(f"asynchronous GRPO: rollout rank {r} sent step {p['step']}'s samples"
                                   f"{' (stopped)' if p.get('stopped') else ''}, the trainer is at {step}")

    def _stop_rollout(self) -> None:
        """Send "stop" to the rollout ranks (once), with the signal of a stop (0: the run ended)."""
        if self.bridge is not None and not self._stopped:
            self._stopped = True
            # with the signal of a SIGTERM stop: every rollout rank exits 143, also one on a node that got none
            self.bridge.broadcast_object({"kind": "stop", "signum": int(self.ctx.stop.signum)})

    def _round(self, step: int, payloads: list[dict]) -> Round:
        """This training rank's groups of the step as a scored round of the synchronous step."""
        # dealt over the data shards, not the training ranks: the tp / cp ranks of a group train on the same samples
        G, M, me = self.rl.batch.group_size, self.grpo.shards.world, self.grpo.shards.rank
        groups = []  # (dataset index, [sample payloads], [total], {label: [values]}, [trajectories] or None)
        for p in payloads:
            trajs = p.get("trajectories")  # [rl.env] (rl/asynchronous/multiturn.py)
            by_prompt: dict[int, list[int]] = {}
            for j, s in enumerate(p["samples"]):
                by_prompt.setdefault(s["prompt_index"], []).append(j)
            for pi, js in sorted(by_prompt.items()):
                if len(js) != G:
                    raise RuntimeError(f"asynchronous GRPO: a group of step {step} has {len(js)} samples, not {G}")
                groups.append((p["indices"][pi], [p["samples"][j] for j in js], [p["total"][j] for j in js],
                               {k: [v[j] for j in js] for k, v in p["per_reward"].items()},
                               [trajs[j] for j in js] if trajs is not None else None))
        if not groups:  # every rank sees the same payloads: all raise, as the synchronous loop's `encode_shard` does
            raise ConfigError(_nothing_encoded(step, payloads))
        # the groups of this shard whose prompts encode here too (one that does not is left out, counted)
        mine = [(g, enc) for g in groups[me::M] if (enc := self._encode_again(g)) is not None]
        if not mine:  # prompts skipped mid-run left this shard without a group: a dummy (loss x 0) keeps it in step
            # (made of another shard's group: this shard's own, if it had any, were just found unreadable here)
            return self._dummy_round([g for i, g in enumerate(groups) if i % M != me] or groups)
        shard_samples, prompts, real, total = [], [], [], []
        per_reward: dict[str, list[float]] = {label: [] for label in self.grpo.reward_labels}
        if any(g[4] is not None for g, _ in mine):
            per_reward["env"] = []
        for gi, ((idx, samples, tot, per, _), enc) in enumerate(mine):
            shard_samples.append(self.train_set[idx])
            prompts.append(enc)
            for s in samples:
                real.append(RolloutSample(prompt_index=gi, sample_index=s["sample_index"], token_ids=s["token_ids"],
                                          logprobs=s["logprobs"], text=s["text"], finish_reason=s["finish_reason"],
                                          prompt_length=s["prompt_length"],
                                          policy_version=int(s["token_versions"].min()) if s["token_versions"].numel() else step,
                                          token_versions=s["token_versions"], routes=s.get("routes")))
            total += tot
            for label in per_reward:
                per_reward[label] += per.get(label, [])
        shard = EncodedShard(shard_samples, prompts)
        result = RolloutResult(samples=real, num_generated_tokens=sum(int(s.token_ids.numel()) for s in real))
        return shape_round(self.rl, self.advantage, shard, result, real, total, per_reward,
                           round_trajectories([g[4] for g, _ in mine]))

    def _encode_again(self, group: tuple) -> Optional[RolloutPrompt]:
        """This trainer's encoding of a group's prompt, checked against the rollout rank's (`check_same_prompt`: an
        encoding that differs is an error). None when the prompt cannot be encoded here although the rollout rank
        could (a video decode past data.video_decode_timeout_s on the busy trainer, a file unreadable for a moment):
        the encoder has counted it (data/skipped_prompts) and logged it as a bad record, as the rollout rank counts its
        own, and the group is left out of the step, as the synchronous loop leaves out a prompt it cannot encode
        (instead of ending the run and losing the steps since the newest checkpoint)."""
        idx, samples = group[0], group[1]
        sample = self.train_set[idx]
        enc = self.encoder.encode(sample)
        if enc is None:
            log.warning("asynchronous GRPO: prompt %s, which the rollout rank encoded, could not be encoded by the "
                        "trainer: its group is left out of this step (a skipped prompt)", getattr(sample, "prompt_id", idx))
            return None
        check_same_prompt(sample, enc, samples)
        return enc

    def _dummy_round(self, groups: list[tuple]) -> Round:
        """A round with no real sample for a data shard left without a group: its update forwards a copy of the prompt
        and first completion of the first of `groups` that encodes here (a multi-turn one: one token of the prompt, as
        the synchronous loop's empty rank) with loss x 0, so the training ranks make the same calls."""
        found = next(((g, enc) for g in groups if (enc := self._encode_again(g)) is not None), None)
        if found is None:
            raise ConfigError(f"data: none of the prompts of this step's {len(groups)} groups could be encoded by the "
                              "trainer, though the rollout ranks encoded them (the warnings above name them)")
        (_, samples, _, _, trajs), enc = found
        s = samples[0]
        dummy = [] if trajs is not None else [RolloutSample(
            prompt_index=0, sample_index=0, token_ids=s["token_ids"], logprobs=s["logprobs"], text=s["text"],
            finish_reason=s["finish_reason"], prompt_length=s["prompt_length"], token_versions=s["token_versions"],
            routes=s.get("routes"))]
        per_reward: dict[str, list[float]] = {label: [] for label in self.grpo.reward_labels}
        return shape_round(self.rl, self.advantage, EncodedShard([], [enc]), RolloutResult(samples=dummy), [], [],
                           per_reward)

    def _staleness(self, step: int, payloads: list[dict]) -> dict[str, float]:
        lags, interrupted, n = [], 0, 0
        for p in payloads:
            for s in p["samples"]:
                v = s["token_versions"]
                n += 1
                if v.numel() == 0:
                    continue
                lag = step - v
                if int(lag.max()) > self.k:
                    raise StalenessError(f"asynchronous GRPO: a sample of step {step} has a token of version {int(v.min())}, "
                                         f"{int(lag.max())} versions old (max_head_offpolicyness = {self.k})")
                lags.append(lag.double())
                interrupted += int(v.max() != v.min())
        lag = torch.cat(lags) if lags else torch.zeros(1, dtype=torch.float64)
        return {"async/version_lag_mean": float(lag.mean()), "async/version_lag_max": float(lag.max()),
                "async/interrupted_samples": float(interrupted), "async/samples": float(n)}

    def train_step(self, step: int, *, log: bool) -> dict[str, float]:
        t_wait = time.perf_counter()
        payloads = self._receive(step)
        wait_s = time.perf_counter() - t_wait
        signum = max((int(p.get("signum", 0)) for p in payloads), default=0)
        if signum and not self.ctx.stop.signum:  # a rollout rank's SIGTERM: the loop's stop check (training ranks
            logging.getLogger("megatron_vlm").warning(  # `log` is the argument here
                "asynchronous GRPO: a rollout rank received signal %d; stopping at this step boundary", signum)
            self.ctx.stop.signum = signum  # only) then saves and stops the job after this step, as for its own
        extra = self._staleness(step, payloads)
        # the rollout ranks' cumulative reward counters replace this rank's (which count only the evaluation's
        # calls) before the step's reward-failure watch reads them: one source, as in the synchronous loop
        for key in payloads[0]["reward_fail"]:
            extra[key] = float(sum(p["reward_fail"][key] for p in payloads))
        # and the rollout ranks' last failed reward call: the line that stops a run whose rewards all fail names it
        last_error = next((p["reward_last_error"] for p in reversed(payloads) if p.get("reward_last_error")), "")
        manager = getattr(self.grpo, "manager", None)
        if last_error and manager is not None:
            manager.last_error = last_error
        timer = PhaseTimer()
        rd = self._round(step, payloads)
        failed: Optional[RewardsAllFailedError] = None
        try:
            metrics = self.grpo.train_on_rounds(step, [rd], timer, extra_metrics=extra)
        except RewardsAllFailedError as e:  # no usable reward for max_failed_steps steps: the run stops after this one
            failed, metrics = e, dict(e.metrics or {})
        if failed is None:
            self.push_s = push_weights(self.model, self.bridge, step + 1, self._trainable)
        end = time.perf_counter()
        busy = sum(p["busy_s"] for p in payloads)
        idle = sum(p["idle_s"] for p in payloads)
        metrics.update({
            "async/trainer_idle_frac": wait_s / max(end - self._last_end, 1e-9),
            "async/trainer_wait_s": wait_s,
            "async/rollout_idle_frac": idle / max(idle + busy, 1e-9),
            "async/weight_push_s": self.push_s,
            "time/rollout_s": sum(p["gen_s"] for p in payloads) / len(payloads),
            "time/reward_s": sum(p["reward_s"] for p in payloads) / len(payloads),
            # the trainer's whole step (the wait for samples, the update, the push), as trainer_idle_frac divides by;
            # the update's phases alone (time/train_s, ...) are logged beside it
            "time/step_s": end - self._last_end,
            # the rollout ranks' generation together: each rank's tokens over its generation time, summed
            "perf/rollout_tokens_per_s": sum(_generated_tokens(p) / p["gen_s"] for p in payloads if p["gen_s"] > 0),
            # the rollout ranks' skips up to this step (a payload's count is its rank's total when it finished the
            # step, not counting the steps it generated ahead) + the trainer's encoder's (held-out prompts, counted over
            # the training ranks by step_metrics): both sets of records are in the run's log, saved with the checkpoint
            "data/skipped_prompts": float(sum(p["skipped"] for p in payloads)) + metrics.get("data/skipped_prompts", 0.0),
        })
        # the policy that generated the step's tokens (their mean version; the synchronous step's own version there)
        metrics["rollout/policy_version"] = float(step) - extra["async/version_lag_mean"]
        if any("preemptions" in p for p in payloads):  # the rollout ranks' preemptions (the on-demand paged pool)
            metrics["rollout/preemptions"] = float(sum(p.get("preemptions", 0.0) for p in payloads))
        self._last_end = end
        metrics["epoch"] = (step + 1) * self.rl.batch.prompts_per_step / len(self.train_set)
        self.totals.add_to(metrics)  # reward/*, data/skipped_prompts: counted on from the checkpoint's totals
        if failed is not None:  # the loop logs the row, saves what would be lost, the run exits 1
            raise StopAfterStep(failed, metrics, wasted=failed.streak)
        return metrics if log or has_moe_report(metrics) else {}

    def finish(self) -> None:
        """Stop the rollout ranks (their steps in flight are dropped), then the synchronous summary."""
        if self.bridge is not None:
            self._stop_rollout()
            if self._prefetch is not None:  # a step asked for but not trained: the rollout ranks answer a "want"
                self._prefetch.get()       # with its samples or, once stopped, with a "stopped" payload; dropped
                self._prefetch = None
        super().finish()
