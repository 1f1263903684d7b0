"""Slot cache for continuous-batching decoding: a fixed pool of sequence slots, each with its own length.

The rollout engine prefills prompts into an ordinary left-padded cache (`model.new_cache`, a
`KVCache` or Nemotron's `HybridCache`), then copies each prefilled row into one or more free slots
(`load_prefix`: the prompt's keys land at positions 0 ... n-1 of the slot, its Mamba2 states and
M-RoPE delta with them). Decoding steps only the slots in `set_active(slots)`: a finished sequence
frees its slot for the next waiting sample while the others keep going, and nothing is padded.

Storage is pre-allocated once: the per-layer `[num_slots, max_len, Hkv, D]` tensors of the cache
`model.new_cache(num_slots, max_len)` returned, which this class wraps (so the KV shape, the
tensor-parallel head shard and the dtype are the family's own). One extra slot (index `num_slots`)
is a scratch slot for the dummy row a lock-stepped rank feeds when it has nothing left.

Same step protocol as `KVCache`, seen by the model as a batch of the active slots: `begin_step(1)`,
per attention layer `attend(layer_idx, q, k, v)` (writes the new key / value at each slot's length
and runs `kernels.decode_attention` on the slot layout; `update` is the fallback that returns the
gathered keys with a padding mask), `end_step()`. `valid_lengths()` and `rope_deltas` are those of
the active slots, so positions continue exactly as with the padded cache. For the hybrid decoder,
`kv` is the cache itself, `kv_index` maps decoder layers to attention slots, and `mamba_state(i)`
hands out the active slots' conv / SSM states, written back to their slots at `end_step`.
Only single-token steps run here: prompts are prefilled elsewhere.

Shared prompts: `load_prefix(slots, ...)` copies one prompt into all of `slots` (a GRPO group's G samples),
so until a slot is loaded again its first n keys equal those of the other slots of that call (either
layout). With `share_prefix_reads` a step passes that to `kernels.decode_attention` as `shared_prefix` (per
active row: the first active row of its group and the prompt length; `prefix_hint_for(slots)` on the host):
the CPU kernel reads each group's prompt once for all its rows instead of once per row, the Triton kernel
reads the root's copy for every row of the group (L2 hits instead of HBM reads). The attention is the same
up to fp32 rounding. On by default on the CPU (measured faster there); on CUDA the engine's
`EngineOptions.share_prefix_reads` turns it on (off by default: on an H200 the 3B graph step gained 1-2 %,
within noise). A static step takes the hint as device buffers (`set_active_static(slot_ids, shared_prefix=...)`,
filled by the runner).

Static steps (`set_active_static(slot_ids)`, the CUDA-graph decode runner: inference/decode_graphs.py):
the active slots are a device tensor of a fixed size (a batch-size bucket, extra rows on the scratch
slot) and a step reads nothing from the host: attention spans the whole slot capacity (a constant
`max_seqlen_k`, masking by the device lengths), `seq_len` is the constant capacity, and the host
lengths are left to the runner (a replayed graph runs no Python). The checks `begin_step` makes on the
host (a full slot) are the runner's then.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from megatron_vlm import kernels
from megatron_vlm.models.common.kv_cache import KVCache
from megatron_vlm.models.common.mamba2 import Mamba2State

__all__ = ["SlotCache", "PagedSlotCache", "hint_dtype"]


def hint_dtype(device: torch.device) -> torch.dtype:
    """Integer type of the `shared_prefix` tensors: the kernel's own (int32 for Triton, int64 for the CPU op), so no
    layer converts them."""
    return torch.long if device.type == "cpu" else torch.int32


def _kv_part(cache) -> KVCache:
    return cache if isinstance(cache, KVCache) else cache.kv



def _prompt_positions(src, row: int, length: Optional[int]) -> tuple[int, Any]:
    """(the prompt's token count n, the index of its positions among the row's first `src.seq_len`): left padding
    puts them last, so with the count known on the host (`length`) they are a slice; else the row's mask (read from
    the device)."""
    if length is not None:
        if not 0 < length <= src.seq_len:
            raise ValueError(f"SlotCache: a prompt of {length} tokens in a prefill of {src.seq_len} positions")
        return length, slice(src.seq_len - length, src.seq_len)
    valid = src.mask[row, : src.seq_len]
    return int(valid.sum()), valid

class SlotCache:
    def __init__(self, storage) -> None:
        """`storage`: an empty cache from `model.new_cache(num_slots + 1, max_len)` (the last slot is scratch)."""
        kv = _kv_part(storage)
        if kv.seq_len:
            raise ValueError("SlotCache: the storage cache must be empty")
        self.keys, self.values = kv.keys, kv.values
        self.num_slots = kv.batch - 1
        self.max_len = kv.max_len
        self._kv_index: Optional[dict[int, int]] = dict(getattr(storage, "_kv_index", {})) or None
        self._mamba: dict[int, Mamba2State] = dict(getattr(storage, "_mamba", {}))
        device = kv.mask.device
        self.device = device
        self.lengths = torch.zeros(kv.batch, dtype=torch.long, device=device)
        self.host_lengths = [0] * kv.batch
        self.slot_rope_deltas = torch.zeros(kv.batch, 1, dtype=torch.long, device=device)
        self._active = torch.zeros(0, dtype=torch.long, device=device)
        self._active_list: list[int] = []
        self._contiguous = True
        self._pending = False
        self._step_states: dict[int, Mamba2State] = {}
        self._pos: Optional[torch.Tensor] = None  # per step: the active slots' write positions
        self._seqlens: Optional[torch.Tensor] = None  # ... and their key counts after the write
        self._flat: Optional[torch.Tensor] = None  # ... and their rows in a layer's flattened cache (eager steps)
        self._max_k = 0  # ... and the longest of those, known on the host
        self._static = False  # set_active_static: a graph-safe step (no host reads)
        self._init_sharing(kv.batch)

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    # ----- filling slots -----
    def load_prefix(self, slots: Sequence[int], prefill, row: int, length: Optional[int] = None) -> None:
        """Copy row `row` of a prefilled left-padded cache (`KVCache` / `HybridCache`) into every slot of `slots`.
        `length`: the prompt's token count, known on the host (the rollout engine's): its keys are then the row's
        last `length` positions, taken without reading the row's mask from the device (its count, and a bool-mask
        index per layer: each a device sync on CUDA)."""
        if self._pending:  # the step's shared_prefix hint would no longer hold
            raise RuntimeError("SlotCache: load_prefix in the middle of a step")
        src = _kv_part(prefill)
        n, valid = _prompt_positions(src, row, length)
        if n > self.max_len:
            raise ValueError(f"SlotCache: a prompt of {n} tokens does not fit slots of {self.max_len}")
        index = torch.as_tensor(list(slots), dtype=torch.long).to(self.device, non_blocking=True)
        for layer in range(len(self.keys)):
            k = src.keys[layer][row, : src.seq_len][valid]
            v = src.values[layer][row, : src.seq_len][valid]
            self.keys[layer][index, :n] = k.to(self.keys[layer].dtype)
            self.values[layer][index, :n] = v.to(self.values[layer].dtype)
        for i, state in self._mamba.items():
            src_state = prefill._mamba[i]
            state.conv_state[index] = src_state.conv_state[row]
            state.ssm_state[index] = src_state.ssm_state[row]
        self.lengths[index] = n
        self.slot_rope_deltas[index] = src.rope_deltas[row].to(self.device)
        for s in slots:
            self.host_lengths[s] = n
        self._note_shared(slots, n)

    # ----- shared prompts (module docstring) -----
    def _init_sharing(self, rows: int) -> None:
        self._share_group = [-1] * rows  # per slot: the load_prefix call its prompt came from (-1: none) ...
        self._share_len = [0] * rows  # ... and that prompt's length
        self._share_calls = 0
        self._share_hint: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # the current eager step's
        self._static_hint: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # the static steps' buffers
        self.share_prefix_reads = self.device.type == "cpu"

    def _note_shared(self, slots: Sequence[int], n: int) -> None:
        """`slots` were just loaded with one prompt of n tokens: the same keys up to n, nothing of another group."""
        self._share_calls += 1
        for s in slots:
            self._share_group[s] = self._share_calls if len(slots) > 1 else -1
            self._share_len[s] = n

    def prefix_hint_for(self, slots: Sequence[int]) -> Optional[tuple[list[int], list[int]]]:
        """`shared_prefix` of a step over `slots` (kernels/reference/decode_attention.py), as host lists: each row
        of a group with two or more rows here points at the group's first row; None when no group has two."""
        first: dict[int, int] = {}
        count: dict[int, int] = {}
        for b, s in enumerate(slots):
            g = self._share_group[s]
            if g >= 0:
                first.setdefault(g, b)
                count[g] = count.get(g, 0) + 1
        if not any(c > 1 for c in count.values()):
            return None
        rows, lens = [], []
        for b, s in enumerate(slots):
            g = self._share_group[s]
            shared = g >= 0 and count[g] > 1
            rows.append(first[g] if shared else b)
            lens.append(self._share_len[s] if shared else 0)
        return rows, lens

    def _prefix_hint(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The eager step's hint on the cache's device (made once per step, read by every layer)."""
        hint = self.prefix_hint_for(self._active_list)
        if hint is None:
            return None
        both = torch.tensor(hint, dtype=hint_dtype(self.device)).to(self.device, non_blocking=True)
        return both[0], both[1]

    def reset_scratch(self) -> None:
        """Rewind the scratch slot to one (garbage) cached token before a dummy step: never empty, so a
        model does not mistake the step for a prefill, and never full however many dummy steps run."""
        self.lengths[self.scratch_slot] = 1
        self.host_lengths[self.scratch_slot] = 1

    def set_active(self, slots: Sequence[int]) -> None:
        """The slots the next step runs, in the row order of its input batch."""
        if self._pending:
            raise RuntimeError("SlotCache: cannot change the active slots in the middle of a step")
        slots = [int(s) for s in slots]
        if not slots:
            raise ValueError("SlotCache: a step needs at least one active slot")
        self._active_list = slots
        self._contiguous = slots == list(range(len(slots)))
        # copied without waiting for the device: a tensor made on it from a list waits for every queued kernel
        self._active = torch.as_tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
        self._static = False

    def set_active_static(self, slot_ids: torch.Tensor,
                          shared_prefix: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        """The next steps run the slots of the device tensor `slot_ids` (a static buffer whose values the
        caller rewrites between steps; rows it does not use point at the scratch slot): see the module
        docstring. `shared_prefix`: the steps' hint as two static buffers of the same size (rows its groups do
        not use: their own row, length 0), used when `share_prefix_reads` is on. The host lengths of the slots
        are not advanced (the caller's job)."""
        if self._pending:
            raise RuntimeError("SlotCache: cannot change the active slots in the middle of a step")
        if slot_ids.dim() != 1 or slot_ids.dtype != torch.long or slot_ids.numel() == 0:
            raise ValueError(f"SlotCache: slot_ids must be a non-empty 1-D long tensor, got {slot_ids.dtype} "
                             f"{tuple(slot_ids.shape)}")
        if shared_prefix is not None and any(t.shape != slot_ids.shape for t in shared_prefix):
            raise ValueError(f"SlotCache: the static shared_prefix buffers must be [{slot_ids.numel()}] like slot_ids")
        self._active = slot_ids
        self._active_list = []
        self._contiguous = False
        self._static = True
        self._static_hint = shared_prefix if self.share_prefix_reads else None

    def check_rows(self, slots: Sequence[int]) -> None:
        """The host checks of a step over `slots` that a static step cannot make (the runner's): no slot is full."""
        full = [s for s in slots if self.host_lengths[s] >= self.max_len]
        if full:
            raise ValueError(f"SlotCache: slots {full} are full ({self.max_len} tokens)")

    def reset_scratch_state(self) -> None:
        """Device-only rewind of the scratch slot (graph-safe): one cached position, zero Mamba2 states, so the
        padding rows of a static step, however many and however many steps, never run past the slot."""
        s = self.scratch_slot
        self.lengths[s:s + 1].fill_(1)
        for state in self._mamba.values():
            state.conv_state[s:s + 1].zero_()
            state.ssm_state[s:s + 1].zero_()

    # ----- the step protocol the models drive -----
    @property
    def batch(self) -> int:
        return self._active.shape[0] if self._static else len(self._active_list)

    @property
    def seq_len(self) -> int:
        """Longest active sequence (> 0: a slot always holds a prefilled prompt); a static step: the capacity."""
        if self._static:
            return self.max_len
        return max(self.host_lengths[s] for s in self._active_list)

    @property
    def rope_deltas(self) -> torch.Tensor:
        return self.slot_rope_deltas.index_select(0, self._active)

    def valid_lengths(self) -> torch.Tensor:
        return self.lengths.index_select(0, self._active)

    def set_rope_deltas(self, deltas: torch.Tensor) -> None:  # noqa: ARG002 (the prefill cache stores them)
        raise RuntimeError("SlotCache: prompts are prefilled into a padded cache and copied in with load_prefix")

    def begin_step(self, n_new: int, new_mask: Optional[torch.Tensor] = None) -> None:
        if self._pending:
            raise RuntimeError("SlotCache: begin_step called twice without end_step")
        if n_new != 1 or new_mask is not None:
            raise ValueError("SlotCache: decoding steps take exactly one token per active slot, without a mask")
        if self._static:  # no host reads: attention over the whole capacity, masked by the device lengths
            self._pos = self.lengths.index_select(0, self._active)
            self._seqlens = self._pos + 1
            self._max_k = self.max_len
            self._pending = True
            return
        if not self._active_list:
            raise RuntimeError("SlotCache: set_active before a step")
        full = [s for s in self._active_list if self.host_lengths[s] >= self.max_len]
        if full:
            raise ValueError(f"SlotCache: slots {full} are full ({self.max_len} tokens)")
        # the same for every layer of the step: computed once here, not per layer
        self._pos = self.lengths.index_select(0, self._active)
        self._seqlens = self._pos + 1
        self._max_k = self.seq_len + 1
        # the new keys' rows in the [slots * max_len, Hkv, D] view of a layer's cache: one index_copy_ per
        # layer instead of a two-index index_put_ (~3x cheaper at decode sizes; the same writes)
        self._flat = self._active * self.max_len + self._pos
        self._share_hint = self._prefix_hint() if self.share_prefix_reads else None
        self._pending = True

    def _write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self._pending:
            raise RuntimeError("SlotCache: attend / update outside begin_step / end_step")
        if k.shape[:2] != (self.batch, 1):
            raise ValueError(f"SlotCache: layer {layer_idx} k has shape {tuple(k.shape)}, expected [{self.batch}, 1, ...]")
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self._flat is not None and keys.is_contiguous() and values.is_contiguous():
            keys.view(-1, *keys.shape[2:]).index_copy_(0, self._flat, k[:, 0].to(keys.dtype))
            values.view(-1, *values.shape[2:]).index_copy_(0, self._flat, v[:, 0].to(values.dtype))
        else:  # a static (graph) step, or a cache that is not one block
            kernels.kv_cache_write(k[:, 0], v[:, 0], keys, values, self._active, self._pos)
        return self._seqlens

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, 1, Hq, D], k / v [B, 1, Hkv, D] of the active slots -> attention output [B, 1, Hq, D]."""
        seqlens = self._write(layer_idx, k, v)
        hint = self._static_hint if self._static else self._share_hint
        out = kernels.decode_attention(
            q[:, 0], self.keys[layer_idx], self.values[layer_idx], seqlens,
            slot_ids=None if self._contiguous else self._active, max_seqlen_k=self._max_k,
            **({} if hint is None else {"shared_prefix": hint}),
        )
        return out.unsqueeze(1)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """Fallback for an attention that does not call `attend`: (keys, values, key_padding_mask) of the
        active slots up to the longest one, gathered."""
        seqlens = self._write(layer_idx, k, v)
        end = self._max_k
        keys = self.keys[layer_idx][:, :end].index_select(0, self._active)
        values = self.values[layer_idx][:, :end].index_select(0, self._active)
        mask = torch.arange(end, device=self.device)[None, :] < seqlens[:, None]
        return keys, values, mask

    def end_step(self) -> None:
        if not self._pending:
            raise RuntimeError("SlotCache: end_step without begin_step")
        self.lengths.index_add_(0, self._active, torch.ones_like(self._active))
        for s in self._active_list:
            self.host_lengths[s] += 1
        for i, state in self._step_states.items():
            self._mamba[i].conv_state[self._active] = state.conv_state
            self._mamba[i].ssm_state[self._active] = state.ssm_state
        self._step_states = {}
        self._pos = self._seqlens = self._flat = None
        self._pending = False

    # ----- the hybrid decoder's view (Nemotron-H) -----
    @property
    def kv(self) -> SlotCache:
        return self

    def kv_index(self, layer_idx: int) -> int:
        if self._kv_index is None:
            return layer_idx
        if layer_idx not in self._kv_index:
            raise KeyError(f"SlotCache: layer {layer_idx} is not an attention layer")
        return self._kv_index[layer_idx]

    def mamba_state(self, layer_idx: int) -> Mamba2State:
        """The active slots' state of a Mamba2 layer (a copy the mixer updates in place; written back at end_step)."""
        if layer_idx not in self._mamba:
            raise KeyError(f"SlotCache: layer {layer_idx} is not a Mamba2 layer")
        if layer_idx not in self._step_states:
            full = self._mamba[layer_idx]
            self._step_states[layer_idx] = Mamba2State(
                full.conv_state.index_select(0, self._active), full.ssm_state.index_select(0, self._active)
            )
        return self._step_states[layer_idx]


class PagedSlotCache(SlotCache):
    """The slot cache with its keys in a pool of fixed-size blocks addressed by a block table.

    Why: a slot of `SlotCache` holds `max_len` positions (the longest prompt + the budget) whatever its
    own prompt's length, and the pool is as large as the number of slots times that; on a GPU the KV
    cache is what bounds the batch. Here a sequence holds blocks of the pool: `reserve(slot, tokens)` gives
    a slot the blocks of `tokens` positions, `grow(slot)` one more block as its sequence reaches the end of
    those (the engine's on-demand allocation: a completion holds the blocks of what it has generated, not
    of its whole budget), `release` gives them back; `can_reserve` says whether a sample fits now. Attention
    reads the blocks in place through the table (`kernels.decode_attention(block_table=...)`).

    Static (CUDA-graph) steps work as on the slot layout: the table is a device tensor of a fixed shape
    `[slots + 1, ceil(max_len / block_size)]` whose entries `reserve` / `grow` rewrite between steps, and a
    static step gathers its rows' table rows, write blocks and offsets on the device (no host read); columns
    past a slot's blocks hold stale block ids (in range), which attention never reads (masked by the lengths).
    The host checks of an eager step (a row past its blocks) are `check_rows`, which the step runner calls.

    `storage`: an empty `model.new_cache(num_blocks, block_size)` of an attention-only model (Mamba2
    states are per sequence: the hybrid decoder keeps the slot layout). One block is kept for the
    scratch slot's dummy rows.
    """

    def __init__(self, storage, num_slots: int, max_len: int) -> None:
        if not isinstance(storage, KVCache):
            raise ValueError("PagedSlotCache: needs an attention-only KV cache (Mamba2 states stay in SlotCache)")
        if storage.seq_len:
            raise ValueError("PagedSlotCache: the storage cache must be empty")
        if storage.batch < 2:
            raise ValueError("PagedSlotCache: the pool needs at least 2 blocks (one is the scratch slot's)")
        self.keys, self.values = storage.keys, storage.values
        self.block_size, self.num_blocks = storage.max_len, storage.batch
        self.num_slots, self.max_len = num_slots, max_len
        self.blocks_per_slot = -(-max_len // self.block_size)
        self._kv_index, self._mamba = None, {}
        device = storage.mask.device
        self.device = device
        rows = num_slots + 1
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.host_lengths = [0] * rows
        self.slot_rope_deltas = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self._active = torch.zeros(0, dtype=torch.long, device=device)
        self._active_list = []
        self._contiguous = True
        self._pending = False
        self._step_states = {}
        self._init_sharing(rows)
        self._pos = self._seqlens = None
        self._max_k = 0
        self._static = False
        self.table = torch.zeros(rows, self.blocks_per_slot, dtype=torch.int32, device=device)
        self.slot_blocks: list[list[int]] = [[] for _ in range(rows)]
        self.slot_capacity = [0] * rows
        self.free_blocks = list(range(self.num_blocks - 1, 0, -1))  # block 0: the scratch slot's
        self.slot_blocks[num_slots] = [0]
        self.slot_capacity[num_slots] = self.block_size

    # ----- block bookkeeping -----
    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_reserve(self, tokens: int, headroom: int = 0) -> bool:
        """Whether a slot can take the blocks of `tokens` positions now, leaving `headroom` blocks free."""
        return self.blocks_for(tokens) + headroom <= len(self.free_blocks)

    def grow(self, slot: int) -> bool:
        """One more block for `slot` (its sequence reached the end of its blocks); False when the pool has none."""
        if slot == self.scratch_slot:
            raise ValueError("PagedSlotCache: the scratch slot keeps its one block")
        have = len(self.slot_blocks[slot])
        if have >= self.blocks_per_slot:
            raise ValueError(f"PagedSlotCache: slot {slot} already holds {have} blocks, the most a slot of "
                             f"{self.max_len} positions uses")
        if not self.free_blocks:
            return False
        block = self.free_blocks.pop()
        self.slot_blocks[slot].append(block)
        self.slot_capacity[slot] = (have + 1) * self.block_size
        self.table[slot, have] = block
        return True

    def release_all(self) -> None:
        """Every slot's blocks back to the pool (a kept cache reused by the next call starts empty)."""
        for slot in range(self.num_slots):
            self.release(slot)

    def check_rows(self, slots: Sequence[int]) -> None:
        """The host checks of a step over `slots` (a static step's runner calls it: the step itself reads nothing):
        no slot is full, none is past its blocks."""
        super().check_rows(slots)
        over = [s for s in slots if s != self.scratch_slot and self.host_lengths[s] >= self.slot_capacity[s]]
        if over:
            raise ValueError(f"PagedSlotCache: slots {over} are past their blocks (grow them before the step)")

    def reserve(self, slot: int, tokens: int) -> None:
        """Give `slot` the blocks of `tokens` positions (its prompt + budget); its previous blocks are released."""
        if tokens > self.max_len:
            raise ValueError(f"PagedSlotCache: {tokens} tokens do not fit slots of {self.max_len}")
        self.release(slot)
        need = self.blocks_for(tokens)
        if need > len(self.free_blocks):
            raise RuntimeError(f"PagedSlotCache: {need} blocks needed, {len(self.free_blocks)} free "
                               f"(pool of {self.num_blocks} x {self.block_size} positions)")
        blocks = [self.free_blocks.pop() for _ in range(need)]
        self.slot_blocks[slot] = blocks
        self.slot_capacity[slot] = need * self.block_size
        self.table[slot, :need] = torch.tensor(blocks, dtype=torch.int32).to(self.device, non_blocking=True)

    def release(self, slot: int) -> None:
        """Return a finished slot's blocks to the pool."""
        if slot == self.scratch_slot:
            return
        self.free_blocks.extend(reversed(self.slot_blocks[slot]))
        self.slot_blocks[slot] = []
        self.slot_capacity[slot] = 0

    # ----- filling slots -----
    def load_prefix(self, slots: Sequence[int], prefill, row: int, length: Optional[int] = None) -> None:
        """As `SlotCache.load_prefix`; every slot must hold a reservation covering the prompt."""
        if self._pending:
            raise RuntimeError("PagedSlotCache: load_prefix in the middle of a step")
        src = _kv_part(prefill)
        n, valid = _prompt_positions(src, row, length)
        short = [s for s in slots if self.slot_capacity[s] < n]
        if short:
            raise ValueError(f"PagedSlotCache: slots {short} have no reservation for a prompt of {n} tokens")
        nb = self.blocks_for(n)
        for s in slots:
            blocks = torch.as_tensor(self.slot_blocks[s][:nb], dtype=torch.long).to(self.device, non_blocking=True)
            for layer in range(len(self.keys)):
                for store, cache in ((self.keys[layer], src.keys[layer]), (self.values[layer], src.values[layer])):
                    x = cache[row, : src.seq_len][valid].to(store.dtype)
                    padded = torch.zeros(nb * self.block_size, *x.shape[1:], dtype=store.dtype, device=store.device)
                    padded[:n] = x
                    store[blocks] = padded.view(nb, self.block_size, *x.shape[1:])
        index = torch.as_tensor(list(slots), dtype=torch.long).to(self.device, non_blocking=True)
        self.lengths[index] = n
        self.slot_rope_deltas[index] = src.rope_deltas[row].to(self.device)
        for s in slots:
            self.host_lengths[s] = n
        self._note_shared(slots, n)

    def reset_scratch(self) -> None:
        """The scratch slot's one block, rewound to one (garbage) token as in `SlotCache`."""
        super().reset_scratch()

    # ----- the step protocol -----
    def begin_step(self, n_new: int, new_mask: Optional[torch.Tensor] = None) -> None:
        over = [s for s in self._active_list if self.host_lengths[s] >= self.slot_capacity[s]
                and self.host_lengths[s] < self.max_len and s != self.scratch_slot]
        if over:
            raise ValueError(f"PagedSlotCache: slots {over} are past their blocks (grow them before the step)")
        super().begin_step(n_new, new_mask)
        if self.scratch_slot in self._active_list and self.host_lengths[self.scratch_slot] >= self.block_size:
            raise ValueError("PagedSlotCache: the scratch slot must be rewound with reset_scratch")
        self._step_table = self.table.index_select(0, self._active)
        self._wblock = self._step_table.gather(1, (self._pos // self.block_size)[:, None]).squeeze(1).long()
        self._woff = self._pos % self.block_size

    def _write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self._pending:
            raise RuntimeError("PagedSlotCache: attend / update outside begin_step / end_step")
        if k.shape[:2] != (self.batch, 1):
            raise ValueError(f"PagedSlotCache: layer {layer_idx} k has shape {tuple(k.shape)}, expected [{self.batch}, 1, ...]")
        kernels.kv_cache_write(k[:, 0], v[:, 0], self.keys[layer_idx], self.values[layer_idx], self._wblock, self._woff)
        return self._seqlens

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seqlens = self._write(layer_idx, k, v)
        hint = self._static_hint if self._static else self._share_hint
        out = kernels.decode_attention(q[:, 0], self.keys[layer_idx], self.values[layer_idx], seqlens,
                                       block_table=self._step_table, max_seqlen_k=self._max_k,
                                       **({} if hint is None else {"shared_prefix": hint}))
        return out.unsqueeze(1)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        seqlens = self._write(layer_idx, k, v)
        end = self._max_k
        nb = self.blocks_for(end)
        def gather(store):
            blocks = store.index_select(0, self._step_table[:, :nb].reshape(-1).long())
            return blocks.view(self.batch, nb * self.block_size, *store.shape[2:])[:, :end]
        mask = torch.arange(end, device=self.device)[None, :] < seqlens[:, None]
        return gather(self.keys[layer_idx]), gather(self.values[layer_idx]), mask
