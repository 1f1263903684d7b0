"""A pack of preference pairs with each pair's prompt computed once (DPO and reward-model training).

Why: the preference loader packs pair k's prompt + chosen and prompt + rejected as sequences 2k and 2k + 1
(data/preference_loader.py), so every prompt runs twice through every forward — the policy's, its backward and
the reference's. With prompts as long as the responses that is ~30 % of the tokens of a step (the
benchmarks/trl_dpo.py shape: 4,175 tokens packed plainly, 2,970 shared). `share_pair_prompts` rewrites such a
pack into the prefix-shared layout the GRPO update uses (models/common/prefix_sharing.py): per pair a prefix
segment (the prompt without its last token) and two continuation segments (the prompt's last token followed by
the chosen / the rejected response) that attend to it. Attention, positions and the labelled tokens are those
of the plain pack, so the log-probs, rewards and gradients are the same (to float rounding).

`response_segments` [segments] says which response each segment ends (2k: chosen of pair k, 2k + 1: its
rejected; -1: a prefix segment, which holds no label and ends no response): `pair_sums` (DPO) and `ScoreRoot`
(reward model) read it; a plain pack has none (segment s is response s).

A pair is shared when both its sequences agree on the tokens before their first label and there is at least one
such token; otherwise its two sequences stay as they are. A pack with images keeps one copy of a shared pair's
vision inputs (its `vision_rows` says which rows are whose; a pair whose two sequences do not carry the same ones
stays plain). Packs that bring their own `position_ids` stay plain (computed for the plain layout; the loader's
packs bring none: the families compute RoPE / M-RoPE positions per segment and move each continuation behind its
prefix, models/common/prefix_sharing.py), as do models whose
decoder takes no `prefix_segments` (Mamba2 layers), tensor / context / pipeline parallelism, and a MoE auxiliary loss
(a shared prompt is routed once: the loss would see fewer tokens) — `pair_sharing`; `dpo.prompt_sharing` /
`reward.prompt_sharing = "off"` keeps every pack plain (as GRPO's `rl.update.prompt_sharing`). A MoE model's expert
loads (`moe/*`, the score-correction bias updates) count a shared prompt's tokens once, as in GRPO's update.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_vlm.data.batch import IGNORE_INDEX, VISION_KEYS
from megatron_vlm.models.common.prefix_sharing import accepts_prefix_segments

__all__ = ["pair_sharing", "share_pair_prompts"]


def pair_sharing(bundle: Any, setting: str = "auto", *, key: str = "prompt_sharing") -> tuple[bool, str]:
    """Whether the pair packs of this model bundle are shared (`share_pair_prompts`), and why (for the log).
    `setting`: the config's `key` ("auto": where the layout holds; "off": never)."""
    if setting == "off":
        return False, f"{key} = 'off'"
    model = getattr(bundle, "model", None)
    if model is None or not accepts_prefix_segments(model):
        return False, f"{type(model).__name__}'s decoder does not take shared prompts"
    dims = getattr(bundle, "dims", None)
    if getattr(dims, "tp", 1) > 1 or getattr(dims, "cp", 1) > 1 or getattr(bundle, "pipeline", None) is not None:
        return False, "not with tensor, context or pipeline parallelism"
    balancer = getattr(bundle, "moe_balancer", None)
    if getattr(getattr(balancer, "cfg", None), "aux_loss_coef", 0.0) > 0:
        return False, "moe.aux_loss_coef > 0: the MoE auxiliary loss sees every token of a pack"
    return True, "each pair's prompt computed once in the training and evaluation forwards"


def _shared_length(ids: torch.Tensor, labels: torch.Tensor, a: int, b: int, c: int, d: int) -> int:
    """Tokens of the prefix segment of sequences [a, b) and [c, d): those before the first label of either
    (the last prompt token, whose label is the response's first token, opens each continuation), if equal."""
    first = []
    for lo, hi in ((a, b), (c, d)):
        hit = torch.nonzero(labels[lo:hi] != IGNORE_INDEX)
        first.append(int(hit[0]) if hit.numel() else hi - lo)
    n = min(*first, b - a - 1, d - c - 1)  # each continuation keeps at least one token
    if n < 1 or not torch.equal(ids[a:a + n], ids[c:c + n]):
        return 0
    return n


class _Vision:
    """The vision tensors of a pack split per sequence (`vision_rows`), to keep one copy of a shared prompt's."""

    def __init__(self, pack: dict, sequences: int):
        self.keys = [k for k in VISION_KEYS if pack.get(k) is not None]
        rows = pack.get("vision_rows")
        self.ok = not self.keys or (rows is not None and tuple(rows.shape) == (sequences, len(VISION_KEYS)))
        self.parts: dict[str, list[torch.Tensor]] = {k: [] for k in self.keys}
        if not self.keys or not self.ok or rows is None:
            return
        self.slices: list[dict[str, torch.Tensor]] = []
        offsets = dict.fromkeys(self.keys, 0)
        for s in range(sequences):
            own = {}
            for k in self.keys:
                n = int(rows[s, VISION_KEYS.index(k)])
                own[k] = pack[k][offsets[k]:offsets[k] + n]
                offsets[k] += n
            self.slices.append(own)
        self.ok = all(offsets[k] == pack[k].shape[0] for k in self.keys)

    def same(self, s: int, t: int) -> bool:
        """Sequences s and t hold the same vision inputs (a pair's prompt images, read once when shared)."""
        return all(self.slices[s][k].shape == self.slices[t][k].shape and torch.equal(self.slices[s][k], self.slices[t][k])
                   for k in self.keys)

    def keep(self, s: int) -> None:
        for k in self.keys:
            self.parts[k].append(self.slices[s][k])


def share_pair_prompts(pack: dict) -> dict:
    """The pack with each pair's prompt in one prefix segment (module docstring); the pack itself when it
    cannot be or no pair shares anything."""
    pairs = int(pack["num_pairs"])
    if pairs == 0 or any(pack.get(k) is not None for k in ("position_ids", "prefix_segments")):
        return pack
    ids, labels = pack["input_ids"].reshape(-1), pack["labels"].reshape(-1)
    cu = [int(x) for x in pack["cu_seqlens"].tolist()]
    if len(cu) != 2 * pairs + 1:
        return pack
    vision = _Vision(pack, 2 * pairs)
    if not vision.ok:
        return pack
    id_parts, label_parts, lengths, prefix, responses = [], [], [], [], []

    def segment(lo: int, hi: int, of: int, response: int) -> None:
        id_parts.append(ids[lo:hi])
        label_parts.append(labels[lo:hi])
        lengths.append(hi - lo)
        prefix.append(of)
        responses.append(response)

    shared_any = False
    for k in range(pairs):
        a, b, c, d = cu[2 * k], cu[2 * k + 1], cu[2 * k + 1], cu[2 * k + 2]
        n = _shared_length(ids, labels, a, b, c, d)
        if vision.keys and not vision.same(2 * k, 2 * k + 1):
            n = 0
        if n == 0:
            segment(a, b, -1, 2 * k)
            segment(c, d, -1, 2 * k + 1)
            if vision.keys:
                vision.keep(2 * k)
                vision.keep(2 * k + 1)
            continue
        shared_any = True
        head = len(lengths)
        segment(a, a + n, -1, -1)  # no label inside: n is at most the first labelled position
        segment(a + n, b, head, 2 * k)
        segment(c + n, d, head, 2 * k + 1)
        if vision.keys:
            vision.keep(2 * k)  # the prompt's images, once (the prefix's placeholders)
    if not shared_any:
        return pack
    out = {k: v for k, v in pack.items() if k not in ("input_ids", "labels", "cu_seqlens", "vision_rows")}
    for key, parts in vision.parts.items():
        out[key] = torch.cat(parts)
    out["input_ids"] = torch.cat(id_parts)[None]
    out["labels"] = torch.cat(label_parts)[None]
    out["cu_seqlens"] = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out["prefix_segments"] = torch.tensor(prefix, dtype=torch.long)
    out["response_segments"] = torch.tensor(responses, dtype=torch.long)
    return out
