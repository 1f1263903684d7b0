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

__all__ = ["write_bad_record_summary"]

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
