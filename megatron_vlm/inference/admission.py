"""Admission of waiting samples into free slots: shared prompt prefills, on-demand KV blocks, preemption, lock-step.

One `Admission` per batch of slots of a `generate` call. Samples wait in a queue (group-major: the n samples of
prompt p are p*n ... p*n+n-1); free slots take the next ones. Their prompts, left-padded into one batch, are
prefilled in one forward (`prefill`: the engine's `_prefill`), and each prompt's cache row is copied into the slots
of its samples: a GRPO group shares one prefill (`share_prefix=False`, the benchmark baseline, prefills every sample).
A prompt whose vision tensors cannot be concatenated with those of the round's other prefills (a Nemotron-VL video of
another tile size: `data.packing.shapes_conflict`) ends the round's admissions: it waits, with the samples
behind it, for the next round (after the next token), whose prefill it starts. A round stays one prefill forward.

On the paged pool (`PagedSlotCache`, `rl.rollout.kv_block_size`) blocks are taken on demand, as vLLM does: an
admitted sample takes the blocks of its prompt and one more position, and only when they are free with a headroom
of 1 % of the pool (at least one block) for the running ones to grow; a running sample takes another block when
its sequence reaches the end of its blocks (`grow`); a finished one returns them. When a running sample needs a
block and none is free, the sample admitted last is preempted: its blocks are returned and it waits at the head of
the queue with what it generated (`SlotRun.preempt`); re-admitted, its prompt + generated tokens are prefilled
again (recomputation: the keys of the tokens it had generated are then the current weights') in the same forward
as the round's new prompts, and it continues where it stopped.

Lock-step (`lockstep_admit`: ranks whose forwards run collectives together): after each token a sample whose
group's prompt is prefilled already joins at once (no forward); then `all_ranks_active(needs_a_prefill)` says
whether this is an admission round, in which every rank makes exactly one prefill forward, of the samples it
admits or, with none, of one pad token (`dummy_prefill`: the engine's `_dummy_prefill`).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from megatron_vlm.data.packing import shapes_conflict, vision_shapes
from megatron_vlm.inference.engine import RolloutPrompt
from megatron_vlm.inference.slot_run import SlotRun, resume_prompt
from megatron_vlm.models.common.slot_cache import PagedSlotCache

__all__ = ["Admission", "headroom_blocks", "pool_for_every_slot"]

# prefill(prompts) -> (padded prefill cache, logits of the last position [P, V], routes [P, T, layers, k] or None)
Prefill = Callable[[Sequence[RolloutPrompt]], tuple]


def headroom_blocks(num_blocks: int) -> int:
    """The blocks a waiting sample must leave free on a pool of `num_blocks` while others run (for them to grow): 1 % of
    the pool, at least one."""
    return max(1, num_blocks // 100)


def pool_for_every_slot(num_slots: int, blocks_per_slot: int) -> int:
    """The smallest pool in which every slot can hold its full length (+ the scratch slot's block) and a waiting sample
    is still admitted with the headroom (`headroom_blocks`) when all the others are at full length: it never makes a
    sample wait or preempts one, so samples are admitted as into the slot cache (and draw the same random numbers).
    Without the headroom blocks the last slot's sample waited whenever its prompt filled a slot's blocks."""
    base = 1 + num_slots * blocks_per_slot
    return base + base // 99 + 1  # extra e >= max(1, (base + e) // 100)


class Admission:
    """The queue of one batch's waiting samples and the prompt prefixes prefilled for them (see the module doc)."""

    def __init__(self, run: SlotRun, cache, prompts: Sequence[RolloutPrompt], n: int, *, share_prefix: bool,
                 prefill: Prefill, stats: dict) -> None:
        self.run, self.cache, self.prompts, self.n = run, cache, prompts, n
        self.share_prefix = share_prefix
        self.prefill = prefill
        self.stats = stats
        self.queue = deque(range(len(prompts) * n))
        # prompt key -> [prefill cache, its row, last logits [V], samples still to take it, the prompt's routes]
        self.prefixes: dict = {}
        self.paged = isinstance(cache, PagedSlotCache)

    def key_of(self, sample: int) -> int:
        """The prefill a sample takes its prompt's keys from: its group's (shared prefix) or its own."""
        return sample // self.n if self.share_prefix else sample

    def admit(self, *, cached_only: bool = False) -> tuple[list[int], Optional[torch.Tensor]]:
        """Fill free slots with waiting samples: ([slots], logits [len, V]) or ([], None). `cached_only`: only those that
        need no prefill forward (their group's prompt is prefilled already), stopping at the first that would."""
        run, cache, queue = self.run, self.cache, self.queue
        take: list[tuple[int, int]] = []
        shapes: dict = {}  # the vision tensor shapes of this round's one prefill forward (`vision_shapes`)
        keys: set[int] = set()
        while queue and run.free:
            sample = queue[0]
            needs = sample in run.preempted or (self.key_of(sample) not in self.prefixes
                                                and self.key_of(sample) not in keys)
            if cached_only and needs:
                break
            prompt = self.prompts[sample // self.n]
            if needs and shapes_conflict(shapes, prompt):
                break  # its vision tensors cannot join this prefill's: it waits for the next round (module doc)
            if self.paged:  # on demand: its prompt (+ what it generated before a preemption)
                tokens, headroom = self.blocks_wanted(queue[0], busy=bool(run.slot_sample or take))
                if not cache.can_reserve(tokens, headroom):
                    if not run.slot_sample and not take:  # nothing runs that could give blocks back
                        raise RuntimeError(f"kv_cache_blocks: the pool cannot hold one sample of {tokens} tokens "
                                           f"({len(cache.free_blocks)} free blocks of {cache.block_size})")
                    break
                cache.reserve(run.free[0], tokens)
            if needs:
                shapes = {**vision_shapes(prompt), **shapes}
                keys.add(self.key_of(sample))
            take.append((queue.popleft(), run.free.popleft()))
        if not take:
            return [], None
        for _sample, slot in take:
            run.admitted[slot] = run.admissions
            run.admissions += 1
        back = [(sample, slot) for sample, slot in take if sample in run.preempted]  # preempted, re-admitted
        take = [(sample, slot) for sample, slot in take if sample not in run.preempted]
        resumed = self._prefill_round(take, back)
        if not take:
            return list(resumed), torch.stack(list(resumed.values()))
        # one copy per prefilled row into all of its new slots (a group's G slots at once: the row's keys are
        # gathered once per layer, not once per slot)
        slots_of: dict = {}
        for sample, slot in take:
            slots_of.setdefault(self.key_of(sample), []).append(slot)
        for key, group in slots_of.items():
            entry = self.prefixes[key]
            cache.load_prefix(group, entry[0], entry[1], length=entry[5])
        slots, rows = [], []
        for sample, slot in take:
            entry = self.prefixes[self.key_of(sample)]
            run.start(slot, sample, entry[4])
            slots.append(slot)
            rows.append(entry[2])
            entry[3] -= 1
            if entry[3] == 0:
                del self.prefixes[self.key_of(sample)]
        return list(resumed) + slots, torch.stack(list(resumed.values()) + rows)

    def _prefill_round(self, take: list[tuple[int, int]], back: list[tuple[int, int]]) -> dict[int, torch.Tensor]:
        """One prefill forward of the new prompts `take` needs and of the re-admitted samples' prompt + generated
        tokens (`back`), if any; returns {slot: logits [V]} of the re-admitted."""
        need = list(dict.fromkeys(self.key_of(i) for i, _ in take if self.key_of(i) not in self.prefixes))
        resumed: dict[int, torch.Tensor] = {}
        if not need and not back:
            return resumed
        t0 = time.perf_counter()
        n = self.n
        batch = [self.prompts[k // (1 if self.share_prefix else n)] for k in need]
        batch += [resume_prompt(self.prompts[sample // n], self.run.preempted[sample]) for sample, _ in back]
        pcache, logits, routes = self.prefill(batch)
        uses = n if self.share_prefix else 1
        for row, key in enumerate(need):
            # the prompt's own positions of the left-padded row
            mine = routes[row, routes.shape[1] - len(batch[row]):] if routes is not None else None
            self.prefixes[key] = [pcache, row, logits[row], uses, mine, len(batch[row])]  # the length: on the host
        for j, (sample, slot) in enumerate(back):
            row = len(need) + j
            self.cache.load_prefix([slot], pcache, row, length=len(batch[row]))
            self.run.readmit(sample, slot, routes[row, -1] if routes is not None else None)
            resumed[slot] = logits[row]
        self.stats["prefill_s"] += time.perf_counter() - t0
        self.stats["forward_calls"] += 1
        self.stats["prefill_calls"] += 1
        return resumed

    def lockstep_admit(self, all_ranks_active: Callable[[bool], Any],
                       dummy_prefill: Callable[[], None]) -> tuple[list[int], Optional[torch.Tensor]]:
        """A lock-stepped rank's admissions after a token (module doc): samples whose group's prompt is prefilled
        already join at once (no forward); then an admission round when any rank has a sample that needs a prefill,
        in which this rank makes exactly one prefill forward, real or of one pad token."""
        local = self.admit(cached_only=True)
        want = bool(self.queue and self.run.free)
        if want and self.paged:
            want = self.cache.can_reserve(*self.blocks_wanted(self.queue[0], busy=bool(self.run.slot_sample)))
        if not all_ranks_active(want):
            return local
        calls = self.stats["prefill_calls"]
        out = self.admit() if want else ([], None)
        if self.stats["prefill_calls"] == calls:  # nothing to prefill here
            dummy_prefill()
        if not local[0]:
            return out
        if not out[0]:
            return local
        assert local[1] is not None and out[1] is not None
        return local[0] + out[0], torch.cat([local[1], out[1]])

    def blocks_wanted(self, sample: int, *, busy: bool) -> tuple[int, int]:
        """(positions a waiting sample's blocks must hold now, blocks to leave free) on the on-demand pool: its prompt,
        what it generated before a preemption and the next position; a headroom of 1 % of the pool (>= 1 block)
        while others run, for them to grow."""
        run = self.run
        done = len(run.preempted[sample].tokens) if sample in run.preempted else 0
        return len(self.prompts[sample // self.n]) + done + 1, headroom_blocks(self.cache.num_blocks) if busy else 0

    def grow(self, running: list[int]) -> list[int]:
        """Give every running slot whose sequence reached the end of its blocks one more (on-demand paged cache),
        oldest admission first; with none free, preempt the last admitted (possibly the slot itself). Returns the
        rows of `running` that still run."""
        run, cache = self.run, self.cache
        alive = set(running)
        for slot in sorted(running, key=run.admitted.__getitem__):
            while slot in alive and cache.host_lengths[slot] >= cache.slot_capacity[slot] and not cache.grow(slot):
                victim = max(alive, key=run.admitted.__getitem__)
                self.queue.appendleft(run.preempt(victim, cache))
                alive.discard(victim)
                self.stats["preemptions"] += 1
        return [r for r, slot in enumerate(running) if slot in alive]
