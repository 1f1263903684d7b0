"""The global, world-size-independent sequence of packs over all epochs.

Epoch e visits the usable samples in a permutation drawn from (seed, e) (or in file order when not
shuffling) and first-fit packs them; the packs of epoch 0, then epoch 1, ... form one endless
stream with global index g. Data-parallel rank r takes g = r, r + dp, r + 2 dp, ... — so one
process with k micro-batches per step sees exactly the packs that k processes with one micro-batch
each see, also across epoch boundaries, and a position in the stream (packs consumed) is
meaningful whatever the world size. Plans depend only on (lengths, pack classes, capacity, seed, epoch).

Pack classes (`processing.pack_class`, from the length pass): records whose videos keep their own tensor shape
(Nemotron-VL tiles) are packed only with records of the same class or of class 0 (`first_fit_pack_classes`), so
every planned pack can be concatenated; with every class 0 (every other family) the plan is plain first fit.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict
from typing import Optional

import numpy as np

from megatron_vlm.data.packing import first_fit_pack, first_fit_pack_classes

__all__ = ["PackPlanner"]


class PackPlanner:
    def __init__(self, lengths: np.ndarray, capacity: int, *, seed: int, shuffle: bool, max_open: int = 64,
                 name: str = "data", classes: Optional[np.ndarray] = None):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.classes = None if classes is None or not np.any(classes) else np.asarray(classes, dtype=np.int64)
        self.capacity = int(capacity)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.max_open = int(max_open)
        self.valid = np.nonzero((self.lengths > 0) & (self.lengths <= self.capacity))[0]
        if self.valid.size == 0:
            raise ValueError(f"{name}: no usable samples ({self.lengths.size} records; all bad or longer than "
                             f"max_tokens_per_pack={self.capacity}; see the bad-records summary)")
        self._plans: OrderedDict[int, list[list[int]]] = OrderedDict()
        self._cum = [0]  # _cum[e] = packs in epochs < e

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return self.valid
        rng = np.random.default_rng([self.seed, epoch])
        return self.valid[rng.permutation(self.valid.size)]

    def plan(self, epoch: int) -> list[list[int]]:
        """Packs of `epoch` as lists of sample indices (a few recent epochs are kept)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch not in self._plans:
            if self.classes is None:
                self._plans[epoch] = first_fit_pack(self.lengths, self.order(epoch), self.capacity, self.max_open)
            else:
                self._plans[epoch] = first_fit_pack_classes(self.lengths, self.classes, self.order(epoch), self.capacity,
                                                            self.max_open)
            while len(self._plans) > 3:
                self._plans.popitem(last=False)
        self._plans.move_to_end(epoch)
        return self._plans[epoch]

    def num_packs(self, epoch: int) -> int:
        return len(self.plan(epoch))

    def locate(self, global_index: int) -> tuple[int, int]:
        """(epoch, index within epoch) of the global pack index."""
        if global_index < 0:
            raise ValueError(f"global pack index must be >= 0, got {global_index}")
        while self._cum[-1] <= global_index:
            self._cum.append(self._cum[-1] + self.num_packs(len(self._cum) - 1))
        e = bisect.bisect_right(self._cum, global_index) - 1
        return e, global_index - self._cum[e]

    def efficiency(self, epoch: int) -> float:
        """Real tokens / (packs x capacity) of the epoch's plan."""
        packs = self.plan(epoch)
        return float(self.lengths[self.valid].sum()) / (len(packs) * self.capacity)
