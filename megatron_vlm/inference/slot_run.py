"""The device buffers and bookkeeping of one batch of rollout slots: what each slot's sample generated so far.

A slot holds one sample (a completion being generated) from its admission to its end; `SlotRun` keeps, per slot,
the generated tokens, their behaviour log-probs and policy versions (device buffers, written without a host sync),
the routes of every token fed to an MoE model (routing replay), and the host-side lengths the stop check reads.
A sample preempted for lack of KV blocks (the on-demand paged cache, inference/admission.py) leaves its slot with
what it generated (`Preempted`) and is re-admitted later from a prefill of its prompt + those tokens.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_vlm.inference.engine import RolloutPrompt
from megatron_vlm.models.common.routing_replay import route_dtype

__all__ = ["SlotRun", "Preempted", "resume_prompt"]


@dataclass
class Preempted:
    """A sample preempted for lack of KV blocks (on-demand paged cache): what it generated, kept for its re-admission
    (its prompt + these tokens prefilled again) or, if the call ends first, its result."""
    tokens: torch.Tensor  # [k] sampled tokens (the last one not yet fed to the model)
    logprobs: torch.Tensor
    versions: torch.Tensor
    host_tokens: list  # the stop-string checker's copy (empty without stop strings)
    prompt_routes: Optional[torch.Tensor]  # routing replay: the prompt's routes ...
    routes: Optional[torch.Tensor]  # ... and those of the k - 1 generated tokens fed so far


def resume_prompt(prompt: RolloutPrompt, state: Preempted) -> RolloutPrompt:
    """A preempted sample's prefill: its prompt (vision inputs included) followed by the tokens it generated."""
    return dataclasses.replace(prompt, input_ids=torch.cat([prompt.input_ids.to(torch.long), state.tokens.to("cpu", torch.long)]))


class SlotRun:
    """Device buffers and bookkeeping of one batch of slots (one batch of a `generate` call)."""

    def __init__(self, num_slots: int, budget: int, device, routes_shape: Optional[tuple[int, int, int]] = None) -> None:
        """`routes_shape` (MoE layers, top-k, experts): record the experts of every fed token (routing replay)."""
        rows = num_slots + 1  # + the scratch slot
        self.routes: Optional[torch.Tensor] = None  # [rows, budget, layers, k]: routes of the generated tokens
        self.prompt_routes: dict[int, torch.Tensor] = {}  # slot -> its prompt's routes [prompt, layers, k]
        if routes_shape is not None:
            layers, k, experts = routes_shape
            self.routes = torch.full((rows, budget, layers, k), -1, dtype=route_dtype(experts), device=device)
        self.tokens = torch.zeros(rows, budget, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(rows, budget, dtype=torch.float32, device=device)
        self.versions = torch.zeros(rows, budget, dtype=torch.long, device=device)
        self.gen_len = torch.zeros(rows, dtype=torch.long, device=device)
        self.host_len = [0] * rows
        self.host_tokens: dict[int, list[int]] = {}  # slot -> tokens (only with stop strings)
        self.slot_sample: dict[int, int] = {}
        self.free = deque(range(num_slots))
        self.budget = budget
        self.release: Optional[Callable[[int], None]] = None  # the paged cache's: a finished slot's blocks
        self.finished: dict[int, tuple] = {}  # sample -> (tokens, log-probs, versions, finish reason): device copies
        self.finished_routes: dict[int, torch.Tensor] = {}  # sample -> its routes [prompt + generated - 1, layers, k]
        self.admitted: dict[int, int] = {}  # slot -> when its sample was admitted (the last admitted is preempted first)
        self.admissions = 0
        self.preempted: dict[int, Preempted] = {}  # sample -> what it generated before it was preempted

    def start(self, slot: int, sample: int, prompt_routes: Optional[torch.Tensor]) -> None:
        """`sample` starts generating in `slot` (its prompt's keys are in the slot)."""
        self.slot_sample[slot] = sample
        self.gen_len[slot] = 0
        self.host_len[slot] = 0
        self.host_tokens[slot] = []
        if prompt_routes is not None:
            self.prompt_routes[slot] = prompt_routes

    def finish(self, slot: int, why: str) -> None:
        """Keep the slot's tokens (device copies, no sync) as its sample's result and free the slot."""
        length = self.host_len[slot]
        sample = self.slot_sample.pop(slot)
        self.finished[sample] = (self.tokens[slot, :length].clone(), self.logprobs[slot, :length].clone(),
                                 self.versions[slot, :length].clone(), why)
        prompt_routes = self.prompt_routes.pop(slot, None)
        if self.routes is not None and prompt_routes is not None:  # every token the model read (not the last one)
            self.finished_routes[sample] = torch.cat([prompt_routes, self.routes[slot, :max(length - 1, 0)]])
        self.host_tokens.pop(slot, None)
        self.admitted.pop(slot, None)
        if self.release is not None:
            self.release(slot)
        self.free.append(slot)

    def preempt(self, slot: int, cache) -> int:
        """Return a running slot's blocks to the paged `cache` and keep what its sample generated; returns the sample
        (the caller puts it back at the head of the queue)."""
        k = self.host_len[slot]
        sample = self.slot_sample.pop(slot)
        self.preempted[sample] = Preempted(
            tokens=self.tokens[slot, :k].clone(), logprobs=self.logprobs[slot, :k].clone(),
            versions=self.versions[slot, :k].clone(), host_tokens=self.host_tokens.pop(slot, []),
            prompt_routes=self.prompt_routes.pop(slot, None),
            routes=self.routes[slot, :k - 1].clone() if self.routes is not None else None)
        self.admitted.pop(slot)
        cache.release(slot)
        self.free.append(slot)
        return sample

    def readmit(self, sample: int, slot: int, last_route: Optional[torch.Tensor]) -> None:
        """A preempted sample continues in `slot`, whose keys a prefill of its prompt + the k tokens it generated
        (`resume_prompt`) filled: at token k. `last_route`: the experts of the k-th token, fed only by that prefill."""
        state = self.preempted.pop(sample)
        k = int(state.tokens.numel())
        self.slot_sample[slot] = sample
        self.tokens[slot, :k] = state.tokens
        self.logprobs[slot, :k] = state.logprobs
        self.versions[slot, :k] = state.versions
        self.gen_len[slot] = k
        self.host_len[slot] = k
        self.host_tokens[slot] = list(state.host_tokens)
        if self.routes is not None and state.prompt_routes is not None and state.routes is not None and last_route is not None:
            # the routes recorded when the tokens were first fed; the last token's, fed only now, from this prefill
            self.prompt_routes[slot] = state.prompt_routes
            self.routes[slot, :k - 1] = state.routes
            self.routes[slot, k - 1] = last_route

    def interrupted_waiting(self) -> None:
        """The call ends while preempted samples wait for blocks: what they generated is their result."""
        for sample, state in self.preempted.items():
            self.finished[sample] = (state.tokens, state.logprobs, state.versions, "interrupted")
            if state.prompt_routes is not None and state.routes is not None:
                self.finished_routes[sample] = torch.cat([state.prompt_routes, state.routes])
