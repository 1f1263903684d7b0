"""Metric sinks on rank 0: console progress bar, TensorBoard, CSV (train and eval), optional W&B.

CSV: one file for train, one for eval, with a header of every key of the first row. A file is never
rewritten to add a column (a resumed run appends under the existing header): keys that appear later
go to a per-row `extra` JSON column, so every row stays readable with the same header. A row that cannot
be written (a full disk, a quota) is logged as an error and left out, the file cut back to its last whole
row; training goes on (its next checkpoint save says what is wrong with the disk, and keeps the previous one).

W&B: a call that fails is logged once as an error (until one works again) and the row left out; training goes on.

TensorBoard: a write that fails (a full disk or a quota under the event file) is logged once as an error naming the
folder and the error, and TensorBoard is off for the rest of the run; training goes on. Not retried, unlike the CSV
rows: an event file whose write failed may end in a cut record and cannot be continued, so each retry would open a
new writer, leave a new event file in the folder and, on a disk still full, die in its background thread with a
traceback of its own, row after row. The CSV files keep retrying in place (cheap, no new file), and a resumed run
writes TensorBoard again. The writer thread's own traceback of that error is not printed (`_QuietWriterThreads`):
the one error line says it.

A sink that cannot be opened at the start (a `tensorboard` path that is a file, a metrics CSV that is a folder or
read-only) is a ConfigError on every rank (exit 2 naming `logging.<sink>`), before the first step: a run must not
train for hours and record nothing, nor rank 0 die alone while the others wait in a collective.

A run that starts at step S (a resume, or 0) first drops the rows of steps after S from the train and
eval CSVs: they were written by a run that went further and was then lost (a fallback to an older
checkpoint, a kill -9 after the last save), and the steps are run again, so each step has one row.
"""
from __future__ import annotations

import csv
import errno
import io
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import IO, Optional

from megatron_vlm.checkpoint.manager import gather_errors
from megatron_vlm.durable import write_text_durably
from megatron_vlm.errors import ConfigError

log = logging.getLogger("megatron_vlm")


def _write_all(fh: IO[bytes], data: bytes) -> None:
    """Write every byte of `data` to the unbuffered `fh`, or raise OSError.

    Why a loop: an unbuffered write on a nearly full disk lands the bytes that fit and returns their count without
    raising (write(2) fails with ENOSPC only when nothing fits); taken as done, it left half a row in the file."""
    view = memoryview(data)
    while view:
        n = fh.write(view)
        if not n:  # None (would block) or 0: nothing more goes in
            raise OSError(errno.ENOSPC, f"wrote {len(data) - len(view)} of {len(data)} bytes")
        view = view[n:]


class _CsvSink:
    def __init__(self, path: Path):
        self.path = path
        self.fields: Optional[list[str]] = None
        self._fh: Optional[IO[bytes]] = None
        self._failed = False  # the last write failed (its error is logged once until one works)

    def write(self, row: dict) -> None:
        """Append `row` (module docstring); an OSError is logged and the row left out, never raised."""
        try:
            self._write(row)
            self._failed = False
        except OSError as e:
            if not self._failed:  # once per run of failures, not once per step
                log.error("%s: could not write the row of step %s (%s); training goes on, rows are left out "
                          "until writing works again", self.path.name, row.get("step"), e)
            self._failed = True

    def _write(self, row: dict) -> None:
        header = False
        if self.fields is None:
            exists = self.path.is_file() and self.path.stat().st_size > 0
            if exists:  # resumed run: keep the existing header
                with self.path.open() as f:
                    self.fields = next(csv.reader(f))
            else:
                self.fields = list(row) + ["extra"]
                header = True
        extra = {k: v for k, v in row.items() if k not in self.fields}
        out = dict(row)
        if "extra" in self.fields:
            out["extra"] = json.dumps(extra) if extra else ""
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=self.fields, extrasaction="ignore")
        if header:
            writer.writeheader()
        writer.writerow(out)
        if self._fh is None:  # unbuffered: a failed write leaves nothing pending for a later flush
            self._fh = open(self.path, "ab", buffering=0)  # noqa: SIM115 (held open across writes)
        start = os.fstat(self._fh.fileno()).st_size  # appends go to the end (a position can be stale after a cut)
        try:
            _write_all(self._fh, text.getvalue().encode())
        except OSError:
            os.ftruncate(self._fh.fileno(), start)  # no half row for the next one to follow
            if header:
                self.fields = None  # the header is written with the next row that fits
            raise

    def drop_after(self, step: int) -> int:
        """Remove the rows of steps after `step` (rewritten atomically; before the first write). Returns how many."""
        if self._fh is not None or not self.path.is_file():
            return 0
        with self.path.open(newline="") as f:
            rows = list(csv.reader(f))
        if not rows or not rows[0] or rows[0][0] != "step":
            return 0

        def later(row: list) -> bool:
            try:
                return bool(row) and float(row[0]) > step
            except ValueError:
                return False

        kept = [rows[0]] + [r for r in rows[1:] if not later(r)]
        dropped = len(rows) - len(kept)
        if dropped:
            buf = io.StringIO(newline="")
            csv.writer(buf).writerows(kept)
            write_text_durably(self.path, buf.getvalue())
        return dropped

    def steps(self) -> set[float]:
        """The steps of the rows in the file (none when it does not exist or cannot be read)."""
        try:
            with self.path.open(newline="") as f:
                rows = list(csv.reader(f))
        except OSError:
            return set()
        out = set()
        for row in rows[1:] if rows and rows[0] and rows[0][0] == "step" else []:
            try:
                out.add(float(row[0]))
            except (IndexError, ValueError):
                continue
        return out

    def close(self) -> None:
        if self._fh:
            self._fh.close()


def _unwritable(path: Path) -> Optional[str]:
    """Why `path` cannot be appended to (None: it can, or it can be created)."""
    if path.exists():
        if not path.is_file():
            return "not a regular file"
        return None if os.access(path, os.W_OK) else "not writable"
    return None if os.access(path.parent, os.W_OK) else "its folder is not writable"


class _QuietWriterThreads:
    """A `threading.excepthook` that drops the OSError of a TensorBoard writer thread and passes on everything else.

    The thread dies on a failed event-file write and re-raises, which the default hook prints as a traceback; the
    sink sees the same error at its flush and logs it as one line (module docstring)."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, args) -> None:
        if issubclass(args.exc_type, OSError) and type(args.thread).__module__.startswith("tensorboard.summary.writer"):
            return
        self.previous(args)


def _quiet_writer_threads() -> None:
    if not isinstance(threading.excepthook, _QuietWriterThreads):
        threading.excepthook = _QuietWriterThreads(threading.excepthook)


class _TensorBoardSink:
    """Scalars and text in `<run>/tensorboard` (module docstring: a failed write is logged once, never raised, and
    turns the sink off)."""

    def __init__(self, folder: Path, writer_cls):
        self.folder = folder
        _quiet_writer_threads()
        self._writer = writer_cls(str(folder))

    def write(self, what: str, step: int, fn) -> None:
        """Call `fn(writer)` and flush; an OSError is logged and the sink off for the rest of the run."""
        if self._writer is None:
            return
        try:
            fn(self._writer)
            self._writer.flush()
        except OSError as e:
            log.error("tensorboard: could not write %s of step %s in %s (%s); TensorBoard is off for the rest of this "
                      "run, training goes on (logging.csv keeps writing the rows it can; a resumed run writes "
                      "TensorBoard again)", what, step, self.folder, e)
            self._writer = None  # not closed: its close flushes first, and raises the thread's error again

    def close(self) -> None:
        if self._writer is not None:
            try:
                self._writer.close()
            except OSError as e:
                log.error("tensorboard: could not close the event file in %s (%s)", self.folder, e)


def _open_tensorboard(folder: Path) -> Optional[_TensorBoardSink]:
    """The TensorBoard sink (None without the package); a folder that cannot be written is a ConfigError."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning("logging.tensorboard = true but tensorboard is not installed; skipping it")
        return None
    try:
        return _TensorBoardSink(folder, SummaryWriter)
    except OSError as e:
        raise ConfigError(f"logging.tensorboard: cannot write TensorBoard files in {folder} ({e}); free the path "
                          "or set logging.tensorboard = false") from None


class MetricsLogger:
    def __init__(self, log_cfg, output_dir: Path, *, is_main: bool, total_steps: int, run_name: str,
                 config_dict: Optional[dict] = None):
        self.is_main = is_main
        self.cfg = log_cfg
        self.total_steps = total_steps
        self.t0 = time.time()
        self.start_step = 0
        self._tb: Optional[_TensorBoardSink] = None
        self._wandb = self._bar = None
        self._wandb_failed = False
        self._csv: dict[str, _CsvSink] = {}
        self.output_dir = output_dir
        if not is_main:
            return
        if log_cfg.tensorboard:
            self._tb = _open_tensorboard(output_dir / "tensorboard")
        if log_cfg.csv:
            self._csv = {"train": _CsvSink(output_dir / "metrics_train.csv"),
                         "eval": _CsvSink(output_dir / "metrics_eval.csv")}
            for sink in self._csv.values():
                problem = _unwritable(sink.path)
                if problem:
                    raise ConfigError(f"logging.csv: cannot write {sink.path} ({problem}); free the path or set "
                                      "logging.csv = false")
        if log_cfg.wandb:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("logging.wandb = true but the wandb package is not installed "
                                   "(pip install 'megatron-vlm[wandb]')") from e
            try:  # a bad mode, an unwritable folder, no network in "online" mode: before the first step, every rank
                self._wandb = wandb.init(project=log_cfg.wandb_project, name=log_cfg.experiment_name or run_name,
                                         mode=log_cfg.wandb_mode, dir=str(output_dir), config=config_dict or {})
            except Exception as e:  # noqa: BLE001 - wandb's own error classes vary by version
                self.close()
                raise ConfigError(f"logging.wandb: wandb.init failed ({type(e).__name__}: {e}); check logging.wandb_mode "
                                  "/ logging.wandb_project (\"offline\" needs no network) or set logging.wandb = false") from None
        if log_cfg.console and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, dynamic_ncols=True, desc="train")

    def set_start(self, step: int) -> None:
        """The run starts after `step` steps: drop CSV rows of later steps (module docstring)."""
        self.start_step = step
        self.t0 = time.time()
        for sink in self._csv.values():
            dropped = sink.drop_after(step)
            if dropped:
                log.info("%s: dropped %d row(s) of steps after %d (run again from the checkpoint)",
                         sink.path.name, dropped, step)
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def logged(self, split: str, step: int) -> Optional[bool]:
        """Whether the `split` CSV holds a row of `step` (a run resumed at `step` asks whether that step's evaluation
        ran: training/loop.py); None where this process cannot tell (not rank 0, or no CSV)."""
        sink = self._csv.get(split)
        return None if sink is None else float(step) in sink.steps()

    def eta_s(self, step: int) -> float:
        done = step - self.start_step
        if done <= 0:
            return float("nan")
        return (time.time() - self.t0) / done * (self.total_steps - step)

    def log(self, split: str, step: int, metrics: dict) -> None:
        if not self.is_main:
            return
        row = {"step": step, **{k: (float(v) if hasattr(v, "__float__") else v) for k, v in metrics.items()}}
        if split in self._csv:
            self._csv[split].write(row)
        if self._tb is not None:
            def scalars(tb) -> None:
                for k, v in row.items():
                    if k != "step" and isinstance(v, (int, float)):
                        tb.add_scalar(f"{split}/{k}", v, step)

            self._tb.write(f"the {split} row", step, scalars)
        self._wandb_log({f"{split}/{k}": v for k, v in row.items() if k != "step"}, step)
        if self.cfg.console and not (split == "train" and "loss" not in row):
            if split == "train":
                eta = self.eta_s(step)
                msg = (f"step {step}/{self.total_steps} loss {row.get('loss', float('nan')):.4f} "
                       f"lr {row.get('lr', 0):.3g} tok/s {row.get('tokens_per_s', 0):.0f} "
                       f"grad_norm {row.get('grad_norm', 0):.3f} eta {eta:.0f}s")
            else:
                msg = f"[{split}] step {step} " + " ".join(
                    f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items() if k != "step")
            if self._bar is not None:
                self._bar.n = step
                self._bar.set_postfix_str(msg, refresh=True)
            log.info(msg)

    def log_table(self, name: str, step: int, header: list[str], rows: list[list]) -> None:
        """A small table (e.g. per-layer expert load) to TensorBoard text and W&B."""
        if not self.is_main:
            return
        if self.cfg.csv:
            key = name.replace("/", "_")
            if key not in self._csv:
                self._csv[key] = _CsvSink(self.output_dir / f"{key}.csv")
            for r in rows:
                self._csv[key].write({"step": step, **dict(zip(header, r))})
        if self._tb is not None:
            md = "| " + " | ".join(header) + " |\n|" + "---|" * len(header) + "\n"
            md += "\n".join("| " + " | ".join(str(c) for c in r) + " |" for r in rows)
            self._tb.write(name, step, lambda tb: tb.add_text(name, md, step))
        if self._wandb is not None:
            import wandb

            self._wandb_log({name: wandb.Table(columns=header, data=rows)}, step)

    def _wandb_log(self, data: dict, step: int) -> None:
        """One W&B log call; an error is logged once (until a call works again) and the row left out."""
        if self._wandb is None:
            return
        try:
            self._wandb.log(data, step=step)
            self._wandb_failed = False
        except Exception as e:  # noqa: BLE001 - W&B raises its own error types; a metrics sink never ends the run
            if not self._wandb_failed:
                log.error("wandb: could not log step %s (%s: %s); training goes on, W&B rows are left out until "
                          "logging works again", step, type(e).__name__, e)
            self._wandb_failed = True

    def log_moe_table(self, step: int, table: list) -> None:
        """The per-layer expert-load table of a MoE workload report (rows = layers, one column per expert)."""
        if table:
            header = ["layer"] + [f"e{i}" for i in range(len(table[0]))]
            self.log_table("moe/layer_expert_table", step, header, [[i, *row] for i, row in enumerate(table)])

    def close(self) -> None:
        for s in self._csv.values():
            s.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception as e:  # noqa: BLE001 - the run's outputs are written: a W&B error does not fail it
                log.error("wandb: could not finish the run (%s: %s)", type(e).__name__, e)
        if self._bar is not None:
            self._bar.close()


def build_metrics_logger(ctx, total_steps: int, config_dict: dict) -> MetricsLogger:
    """The run's logger: `[logging]` sinks in the run folder; `config_dict` (the resolved config as
    plain data) goes to W&B. Passed in rather than computed here so that training/ does not depend on
    the config package, which composes every component's section (training included).

    Collective: rank 0's sink that cannot be opened is a ConfigError on every rank (module docstring)."""
    logger, err = None, None
    try:
        logger = MetricsLogger(ctx.cfg.logging, ctx.run_dir, is_main=ctx.env.is_main, total_steps=total_steps,
                               run_name=ctx.run_dir.name, config_dict=config_dict)
    except ConfigError as e:
        err = str(e)
    failed = next((e for e in gather_errors(err) if e), None)  # rank 0's: only it opens sinks
    if failed is not None:
        if logger is not None:
            logger.close()
        raise ConfigError(failed)
    assert logger is not None
    return logger
