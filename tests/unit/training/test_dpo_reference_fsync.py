"""The DPO reference files reach the disk before they are trusted: file fsynced, renamed, folder fsynced.

The complete reference file (`dpo_reference_logps.pt`) is read back at every later start of the run instead of
scoring the pass again, so a copy that the page cache had not yet written when the host died (power loss, a kernel
panic) would be read as the reference: a file cut short, or a name that never reached the folder. Written like the
checkpoint files: a temporary name, fsync, rename over the final name, fsync of the folder. The order of those
system calls is what the tests observe (each fsync is mapped back to the path it was called on), and a failure in
the middle of a write leaves neither a file under the final name nor the temporary one.
"""
from __future__ import annotations

import os

import pytest
import torch

from megatron_vlm.data.batch import IGNORE_INDEX
from megatron_vlm.training.dpo.reference import REFERENCE_FILE, REFERENCE_PARTIAL_FILE, PrecomputedReference, ReferencePassStopped
from tests.unit.durable_io import assert_durable, record_io
from tests.unit.training.test_dpo_reference import _pack


class _Scorer(torch.nn.Module):
    def forward(self, batch):
        pos = torch.nonzero(batch["labels"].reshape(-1) != IGNORE_INDEX).flatten()
        return -(pos.double() + 1) / 10


class _Loader(list):
    num_pairs = 3


def _packs():
    return [_pack([2, 0], [5, 6, 4, 7]), _pack([1], [6, 5])]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="maps descriptors to paths through /proc")
def test_the_complete_reference_file_is_fsynced_renamed_and_its_folder_fsynced(tmp_path, monkeypatch):
    events = record_io(monkeypatch)
    PrecomputedReference.load_or_compute(tmp_path, _Scorer(), {"train": _Loader(_packs())}, device=torch.device("cpu"),
                                         copies=1, is_main=True, model_path="m")
    assert_durable(events, tmp_path / REFERENCE_FILE)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="maps descriptors to paths through /proc")
def test_the_partial_reference_file_of_a_stopped_pass_is_written_durably(tmp_path, monkeypatch):
    events = record_io(monkeypatch)
    with pytest.raises(ReferencePassStopped):
        PrecomputedReference.load_or_compute(tmp_path, _Scorer(), {"train": _Loader(_packs())},
                                             device=torch.device("cpu"), copies=1, is_main=True, model_path="m",
                                             stop=lambda: True)
    assert_durable(events, tmp_path / REFERENCE_PARTIAL_FILE)


def test_a_failure_while_writing_leaves_no_file_under_the_final_name_and_no_temporary(tmp_path, monkeypatch):
    """torch.save failing halfway (a full disk): no reference file to be trusted at the next start, and no stray
    temporary file left in the run folder; the next start scores the pass and writes the file."""
    real_save = torch.save

    def failing_save(obj, f, *a, **k):
        real_save(obj, f, *a, **k)  # the bytes are written, then the disk fills up
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="No space left"):
        PrecomputedReference.load_or_compute(tmp_path, _Scorer(), {"train": _Loader(_packs())},
                                             device=torch.device("cpu"), copies=1, is_main=True, model_path="m")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.setattr(torch, "save", real_save)
    PrecomputedReference.load_or_compute(tmp_path, _Scorer(), {"train": _Loader(_packs())}, device=torch.device("cpu"),
                                         copies=1, is_main=True, model_path="m")
    assert sorted(p.name for p in tmp_path.iterdir()) == [REFERENCE_FILE]
