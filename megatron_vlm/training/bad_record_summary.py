"""One `bad_records.json` per run, whatever the job kind: every rank's skipped records gathered and
written by rank 0 at the end of the run (SFT's loader and GRPO's prompt reader / encoder log into a
`BadRecordLog` each; the summary keeps each entry's skip count, so a record skipped again after a
resume or in a later epoch is counted, not listed twice). A summary that cannot be written (a full disk) is
logged and skipped: it must not crash a run ahead of the checkpoint save, which reports a full disk as one
clear error with the previous checkpoint intact."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from megatron_vlm.checkpoint.hf import describe_error
from megatron_vlm.data.bad_records import BadRecordLog, merge_by_shard
from megatron_vlm.parallel.collectives import all_gather_objects

__all__ = ["restore_saved_bad_records", "save_bad_records", "write_bad_record_summary"]

log = logging.getLogger("megatron_vlm")


def write_bad_record_summary(bad_records: Optional[BadRecordLog], run_dir: Path, *, is_main: bool,
                             announce: bool = True, dp_rank: Optional[int] = None) -> None:
    """Collective: every rank calls it. Rank 0 writes `<run_dir>/bad_records.json` and, with `announce`
    (the end of the run; not the copy written with each checkpoint), logs a warning with the counts by
    category when anything was skipped. `dp_rank`: this rank's data-parallel coordinate; the ranks that
    share one (tp, cp ranks and pp stages read the same packs, so they skip the same records) count once,
    by the lowest rank of each."""
    if bad_records is None:
        return
    gathered = all_gather_objects((dp_rank, bad_records.to_dict()["records"]))
    if not is_main:
        return
    merged = merge_by_shard(gathered)  # in rank order: global rank 0 first (it holds the planning-time records)
    path = Path(run_dir) / "bad_records.json"
    try:
        merged.write_summary(path)
    except OSError as e:  # a full disk or a read-only file: the run's checkpoint / export decides, with a clear error
        log.warning("could not write %s (%s); the run goes on without it (the skipped records are also saved in "
                    "each checkpoint's data state)", path, describe_error(e))
        return
    if announce and len(merged):
        log.warning("skipped %d bad records %s; see %s", len(merged), merged.counts_by_category(), path)


def save_bad_records(state: dict, bad_records: Optional[BadRecordLog], run_dir: Path, *, is_main: bool,
                     dp_rank: Optional[int]) -> dict:
    """A checkpoint's data state gets this rank's skipped records, and `bad_records.json` is written (collective:
    every rank saves), so a run killed or failed later leaves the summary of everything up to its checkpoint."""
    if bad_records is not None:
        state["bad_records"] = bad_records.to_dict()["records"]
        write_bad_record_summary(bad_records, run_dir, is_main=is_main, announce=False, dp_rank=dp_rank)
    return state


def restore_saved_bad_records(bad_records: Optional[BadRecordLog], state: dict, *, same_split: bool,
                              is_main: bool) -> None:
    """Put back the records skipped before the checkpoint (their packs are not read again after the resume),
    except those this run already found while planning (counted once). A rank that did not write the
    checkpoint (another data-parallel size: ranks without their own extra file take rank 0's) restores
    nothing, so rank 0's records are not counted twice."""
    saved = state.get("bad_records") or []
    if bad_records is None or not saved or not (same_split or is_main):
        return
    have = {(r.source, r.index, r.category) for r in bad_records.entries}
    bad_records.extend([r for r in saved if (r["source"], r["index"], r["category"]) not in have])
