"""Rollout samples -> packed training micro-batches, and per-token tensors back to samples.

A training sample is one completion with its prompt: tokens prompt + response, the response's
behaviour log-probs, its (scalar) advantage, and later its reference / old-policy log-probs. Samples
are packed into micro-batches of at most `max_tokens` tokens (the SFT layout: `input_ids` [1, T],
`cu_seqlens` so attention and M-RoPE positions restart per sample, images of all samples
concatenated in order; a sample whose vision tensors cannot be concatenated with the pack's, a Nemotron-VL
video of another tile size, starts a new pack), with pre-shifted `labels` that are set exactly where the next token is a
response token (`data.batch.shifted_labels`). `TokenLogprobModel` returns the log-probs of the
labelled positions in order, i.e. the response tokens of the micro-batch concatenated sample by
sample — the layout `split_by_response` undoes. Samples that carry the rollout's MoE routes
(`TrainSample.routes`) give the pack a `routes` entry `[T, moe_layers, k]` in the order of `input_ids` (the
routing replay's plan: models/common/routing_replay.py).

A completion's final token is left out of the pack: its position would only predict the token after
the completion, which no loss reads, and under causal attention no earlier position sees it — the
log-probs and gradients are those of the full sequence, with one position per sample less to compute
(the micro-batch plans still count it: a bound).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_vlm.data.batch import IGNORE_INDEX, VISION_KEYS, shifted_labels
from megatron_vlm.data.packing import shapes_conflict, vision_shapes
from megatron_vlm.inference.engine import RolloutPrompt

__all__ = ["TrainSample", "plan_micro_batches", "plan_shared_micro_batches", "pack_samples", "split_by_response",
           "group_by_prompt", "vision_conflict"]



@dataclass
class TrainSample:
    prompt: RolloutPrompt
    response_ids: torch.Tensor
    """[L] generated tokens (L >= 1)."""
    behav_logp: torch.Tensor
    """[L] behaviour log-probs from the rollout engine."""
    advantage: float
    old_logp: Optional[torch.Tensor] = None
    """[L] log-probs of the policy the PPO ratio is taken against (behav_logp unless recomputed)."""
    ref_logp: Optional[torch.Tensor] = None
    """[L] reference-model log-probs (kl_coef > 0)."""
    routes: Optional[torch.Tensor] = None
    """[prompt + L - 1, moe_layers, k] the rollout's experts per token (`RolloutSample.routes`; routing replay)."""
    score: float = 0.0
    """The completion's (shaped) reward: PPO's critic puts it on the last token (advantage = "gae")."""
    token_advantages: Optional[torch.Tensor] = None
    """[L] per-token advantages (advantage = "gae": GAE over the critic's values); None: `advantage` on every token."""
    old_values: Optional[torch.Tensor] = None
    """[L] the critic's values of the rollout, before this step's critic updates (advantage = "gae")."""
    returns: Optional[torch.Tensor] = None
    """[L] the critic's targets, GAE advantages + old values (advantage = "gae")."""
    response_mask: Optional[torch.Tensor] = None
    """Multi-turn trajectories: [len(response_ids)] bool, True on the model's tokens (the only ones trained; the
    environment's turns in between are context). None: every response token is the model's. The per-token
    tensors above (behav_logp, old_logp, ref_logp) then hold the model's tokens only."""
    response_vision: Optional[dict] = None
    """Multi-turn trajectories: the vision inputs of images / videos inside the response (an environment's
    turns), in order; packed after the prompt's."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + int(self.response_ids.numel())

    @property
    def response_length(self) -> int:
        """Trained tokens of the response (all of it unless `response_mask` says otherwise)."""
        if self.response_mask is not None:
            return int(self.response_mask.sum())
        return int(self.response_ids.numel())

    def trained_mask(self) -> torch.Tensor:
        """[len(response_ids)] bool: the response tokens that carry a loss."""
        if self.response_mask is not None:
            return self.response_mask.to(torch.bool)
        return torch.ones(int(self.response_ids.numel()), dtype=torch.bool)


def plan_micro_batches(lengths: Sequence[int], max_tokens: int,
                       samples: Optional[Sequence[TrainSample]] = None) -> list[list[int]]:
    """Consecutive groups of sample indices, each summing to at most max_tokens (a longer sample is
    an error: the prompt encoder already bounds prompt + max_new_tokens). With `samples` (those of
    `lengths`), a sample whose vision tensors cannot join the group's starts a new one (`vision_conflict`)."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    pack = _PackShapes()
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(f"sample {i}: {n} tokens exceed the micro-batch budget of {max_tokens} (data.max_tokens_per_pack)")
        if current and (used + n > max_tokens or (samples is not None and pack.conflicts(samples[i]))):
            groups.append(current)
            current, used, pack = [], 0, _PackShapes()
        current.append(i)
        used += n
        if samples is not None:
            pack.add(samples[i])
    if current:
        groups.append(current)
    return groups


def group_by_prompt(samples: Sequence[TrainSample]) -> list[TrainSample]:
    """`samples` reordered so that the samples of one prompt are adjacent (stable: prompts in order
    of first appearance, samples of a prompt in their order) — what lets a pack share the prompt."""
    first: dict[int, int] = {}
    for i, s in enumerate(samples):
        first.setdefault(id(s.prompt), i)
    return sorted(samples, key=lambda s: first[id(s.prompt)])


def _vision_items(s: TrainSample) -> list:
    """What a sample adds to a pack's vision tensors: its prompt's, and its response's (a multi-turn trajectory)."""
    return [s.prompt, s.response_vision] if s.response_vision else [s.prompt]


def vision_conflict(group: Sequence[TrainSample], s: TrainSample) -> bool:
    """Whether `s` cannot join `group` in one pack: its vision tensors would not concatenate with the group's (a
    Nemotron-VL video keeps its tile size [frames, 3, H, W]: `data.packing.shapes_conflict`). Such a pair of
    samples goes into two packs; packing them together failed the forward (and the step) with a RuntimeError."""
    pack = _PackShapes()
    for g in group:
        pack.add(g)
    return pack.conflicts(s)


class _PackShapes:
    """The merged vision shapes of a pack as samples join it (`vision_conflict`'s, kept up to date), so a planner
    looks at each sample once to join it and once to check it, not at the whole pack again for every sample."""

    def __init__(self) -> None:
        self.shapes: dict = {}

    def conflicts(self, s: TrainSample) -> bool:
        return any(shapes_conflict(self.shapes, item) for item in _vision_items(s))

    def add(self, s: TrainSample) -> None:
        for item in _vision_items(s):
            self.shapes = {**vision_shapes(item), **self.shapes}


def _shareable(prompt: RolloutPrompt, vision_token_ids: frozenset) -> bool:
    return len(prompt) >= 2 and int(prompt.input_ids[-1]) not in vision_token_ids


def _runs(samples: Sequence[TrainSample]) -> list[list[TrainSample]]:
    """Maximal runs of consecutive samples that can share one copy of their prompt: the same prompt object, and no
    response with images of its own (a multi-turn trajectory's environment turns: such a sample is a run alone, packed
    with its own copy of the prompt). The runs `plan_shared_micro_batches` costs, so a pack keeps to its budget when a
    group mixes trajectories with and without an environment's images."""
    runs: list[list[TrainSample]] = []
    for s in samples:
        if runs and runs[-1][0].prompt is s.prompt and not s.response_vision and not runs[-1][-1].response_vision:
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


def plan_shared_micro_batches(samples: Sequence[TrainSample], max_tokens: int,
                              vision_token_ids: frozenset = frozenset()) -> list[list[int]]:
    """`plan_micro_batches` for `pack_samples(..., share_prompts=True)`: a sample whose prompt is
    already in the pack (the previous sample's, neither of them a response with images of its own: `_runs`) costs its
    response + 1 token; a sample whose vision tensors cannot join the group's starts a new one (`vision_conflict`)."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    pack = _PackShapes()
    for i, s in enumerate(samples):
        if s.num_tokens > max_tokens:
            raise ValueError(f"sample {i}: {s.num_tokens} tokens exceed the micro-batch budget of {max_tokens} "
                             "(data.max_tokens_per_pack)")
        shared = (bool(current) and samples[current[-1]].prompt is s.prompt and _shareable(s.prompt, vision_token_ids)
                  and not s.response_vision and not samples[current[-1]].response_vision)
        cost = int(s.response_ids.numel()) + 1 if shared else s.num_tokens
        if current and (used + cost > max_tokens or pack.conflicts(s)):
            groups.append(current)
            current, used, cost, pack = [], 0, s.num_tokens, _PackShapes()
        current.append(i)
        used += cost
        pack.add(s)
    if current:
        groups.append(current)
    return groups


def pack_samples(samples: Sequence[TrainSample], *, share_prompts: bool = False,
                 vision_token_ids: frozenset = frozenset()) -> dict:
    """One packed micro-batch (CPU tensors) for `TokenLogprobModel` / the family model; with
    `share_prompts`, adjacent samples of one prompt share it (module docstring)."""
    if not samples:
        raise ValueError("pack_samples: no samples")
    ids, resp, cu, prefix, completes = [], [], [0], [], []
    vision: dict[str, list[torch.Tensor]] = {k: [] for k in VISION_KEYS}
    route_parts: list[torch.Tensor] = []
    with_routes = _with_routes(samples)

    def segment(parts, mask_parts, of=-1, completion=False, routes=None):
        if with_routes:
            route_parts.append(routes)
        ids.extend(parts)
        resp.extend(mask_parts)
        cu.append(cu[-1] + sum(int(t.numel()) for t in parts))
        prefix.append(of)
        completes.append(completion)

    runs = _runs(samples) if share_prompts else [[s] for s in samples]
    for run in runs:
        prompt = run[0].prompt
        p_ids = prompt.input_ids.to(torch.long)
        shared = len(run) >= 2 and _shareable(prompt, vision_token_ids)

        def add_vision(source) -> None:
            for k in VISION_KEYS:
                v = source.get(k) if isinstance(source, dict) else getattr(source, k)
                if v is not None:
                    vision[k].append(v)
        full = [_token_routes(s) if with_routes else None for s in run]
        if shared:  # the prompt's images once, then the completions
            add_vision(prompt)
            head = len(prefix)
            segment([p_ids[:-1]], [torch.zeros(p_ids.numel() - 1, dtype=torch.bool)], completion=False,
                    routes=head_routes[:p_ids.numel() - 1] if (head_routes := full[0]) is not None else None)
            for s, r in zip(run, full):
                segment([p_ids[-1:], s.response_ids.to(torch.long)],
                        [torch.zeros(1, dtype=torch.bool), s.trained_mask()], of=head,
                        completion=s.response_ids.numel() > 0, routes=r[p_ids.numel() - 1:] if r is not None else None)
        else:  # per sample: its copy of the prompt's images, then its response's (placeholder order)
            for s, r in zip(run, full):
                add_vision(prompt)
                if s.response_vision:
                    add_vision(s.response_vision)
                segment([p_ids, s.response_ids.to(torch.long)],
                        [torch.zeros(p_ids.numel(), dtype=torch.bool), s.trained_mask()],
                        completion=s.response_ids.numel() > 0, routes=r)
    input_ids = torch.cat(ids)
    response_mask = torch.cat(resp)
    labels = shifted_labels(input_ids, response_mask, torch.tensor(cu, dtype=torch.int32))
    # the final token of every completion segment: no label of this pack is read there (module docstring)
    keep = torch.ones(input_ids.numel(), dtype=torch.bool)
    keep[[end - 1 for end, c in zip(cu[1:], completes) if c]] = False
    if bool((labels[~keep] != IGNORE_INDEX).any()):
        raise AssertionError("pack_samples: a completion's final position carries a label")
    lengths = [b - a - int(c) for a, b, c in zip(cu[:-1], cu[1:], completes)]
    batch = {
        "input_ids": input_ids[keep][None],
        "cu_seqlens": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32),
        "labels": labels[keep][None],
        "num_response_tokens": int(response_mask.sum()),
    }
    if with_routes:
        batch["routes"] = torch.cat(route_parts)[keep]
    if any(p >= 0 for p in prefix):
        batch["prefix_segments"] = torch.tensor(prefix, dtype=torch.long)
    for k, parts in vision.items():
        if parts:
            batch[k] = torch.cat(parts)
    return batch


def _with_routes(samples: Sequence[TrainSample]) -> bool:
    """Whether the pack carries routes: every sample has them (a pack of some with, some without is a bug)."""
    have = [s.routes is not None for s in samples]
    if any(have) and not all(have):
        raise ValueError("pack_samples: some samples carry MoE routes and others do not")
    return all(have)


def _token_routes(s: TrainSample) -> torch.Tensor:
    """The sample's routes per token of prompt + response `[P + L, layers, k]`: the recorded ones and a -1 row for
    the final token (no forward of the rollout read it; the pack leaves it out). A record of another length is
    refused, not cut to fit: it belongs to another token layout, and replaying it would route every token after
    the first difference by another token's experts."""
    assert s.routes is not None
    n = s.num_tokens  # a multi-turn trajectory's environment tokens were fed (and routed) too
    if s.routes.dim() != 3 or s.routes.shape[0] != n - 1:
        raise ValueError(f"pack_samples: routes of shape {tuple(s.routes.shape)} for {n - 1} read tokens "
                         f"(prompt {len(s.prompt)} + response {int(s.response_ids.numel())} - 1): the record is of "
                         "another token layout")
    r = s.routes
    return torch.cat([r, r.new_full((1, *r.shape[1:]), -1)])


def split_by_response(values: torch.Tensor, samples: Sequence[TrainSample]) -> list[torch.Tensor]:
    """Per-sample [L_i] pieces of a micro-batch's concatenated per-response-token vector."""
    lengths = [s.response_length for s in samples]
    if values.numel() != sum(lengths):
        raise ValueError(f"values: {values.numel()} entries for {sum(lengths)} response tokens")
    return list(torch.split(values, lengths))
