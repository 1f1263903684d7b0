"""The rank's environment and logging setup, carried into the workers that the worker server starts for it.

Why: a worker is the worker server's child (worker_start.py), not the rank's. It inherits the environment of the rank
when the server started, not a variable set (or removed) after that, and none of the rank's logging setup. So the
rank takes `rank_state()` each time it starts a loader's workers (or the length pass's) and each worker applies it
with `adopt_rank_state()` first thing in its init:

- environment: the worker's `os.environ` becomes the rank's, variables set and removed alike (a library that read a
  variable when the server imported it keeps what it read then: the server preloads torch and the data modules);
- levels: the root logger's, each logger's level the rank set (the library's `megatron_vlm` included), and
  `logging.disable`;
- handlers of the root logger and of the library's `megatron_vlm` logger. A handler holds a lock and an open stream
  and does not pickle, so each is rebuilt in the worker with its level and formatter (a formatter that does not
  pickle, or whose class lives in the entry script, becomes a plain one with the same format):
  a file handler (a rotating one included) appends to the same file and reopens it when the rank rotates it
  (`WatchedFileHandler`; a worker never rotates); a stream handler on stdout or stderr writes to the worker's (the
  rank's when the server started: a rank that replaced `sys.stdout` later is not followed); the handlers no worker
  can reach (an in-memory stream, a socket, a queue, a custom class) have one stderr handler stand in for them, with
  the first one's level and format, unless the logger writes to stderr already. `NullHandler`s are left out.
"""
from __future__ import annotations

import logging
import logging.handlers
import os
import pickle
import sys
from typing import Any, Optional

__all__ = ["rank_state", "adopt_rank_state"]

_CARRIED_HANDLERS = ("", "megatron_vlm")
"""The loggers whose handlers reach the workers: the root logger, and the library's own."""


def _formatter(fmt: Optional[logging.Formatter]) -> Any:
    """`fmt` itself where it pickles to a worker, else (format, date format, style)."""
    if fmt is None:
        return None
    if type(fmt).__module__ not in ("__main__", "__mp_main__"):
        try:
            pickle.dumps(fmt, protocol=pickle.HIGHEST_PROTOCOL)
            return fmt
        except Exception:  # a formatter holding something unpicklable: keep its format
            pass
    style = {logging.StrFormatStyle: "{", logging.StringTemplateStyle: "$"}.get(type(fmt._style), "%")
    return (fmt._fmt, fmt.datefmt, style)


def _handler(h: logging.Handler) -> Optional[tuple]:
    """(target, level, formatter) of a handler, the target being ("file", path, encoding), "stdout" or "stderr"."""
    if isinstance(h, logging.NullHandler):
        return None
    if isinstance(h, logging.FileHandler):
        target: Any = ("file", h.baseFilename, h.encoding)
    elif isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.__stdout__):
        target = "stdout"
    elif isinstance(h, logging.StreamHandler) and h.stream in (sys.stderr, sys.__stderr__):
        target = "stderr"
    else:
        target = "other"  # no way to a worker: one stderr handler stands in for them (module docstring)
    return (target, h.level, _formatter(h.formatter))


def rank_state() -> dict:
    """What a worker adopts from this process (module docstring): environment, logger levels and handlers."""
    manager = logging.Logger.manager
    levels = {name: lg.level for name, lg in list(manager.loggerDict.items())  # a copy: threads add loggers
              if isinstance(lg, logging.Logger) and lg.level != logging.NOTSET}
    handlers = {}
    for name in _CARRIED_HANDLERS:
        lg = logging.getLogger(name)
        handlers[name] = ([d for d in (_handler(h) for h in lg.handlers) if d is not None], lg.propagate)
    return {"env": dict(os.environ), "root_level": logging.getLogger().level, "levels": levels,
            "disable": manager.disable, "handlers": handlers}


def _build(target: Any, level: int, fmt: Any) -> logging.Handler:
    h: logging.Handler
    if isinstance(target, tuple):
        _, path, encoding = target
        h = logging.handlers.WatchedFileHandler(path, mode="a", encoding=encoding, delay=True)
    else:
        h = logging.StreamHandler(sys.stdout if target == "stdout" else sys.stderr)
    h.setLevel(level)
    if isinstance(fmt, tuple):
        fmt = logging.Formatter(fmt[0], fmt[1], style=fmt[2])
    if fmt is not None:
        h.setFormatter(fmt)
    return h


def adopt_rank_state(state: Optional[dict]) -> None:
    """Make this worker's environment and logging the rank's (`rank_state()`)."""
    if not state:
        return
    env = state["env"]
    for key in [k for k in os.environ if k not in env]:
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    logging.getLogger().setLevel(state["root_level"])
    for name, level in state["levels"].items():
        logging.getLogger(name).setLevel(level)
    logging.disable(state["disable"])
    for name, (described, propagate) in state["handlers"].items():
        lg = logging.getLogger(name)
        for h in lg.handlers[:]:
            lg.removeHandler(h)
        for target, level, fmt in _standing_in(described):
            lg.addHandler(_build(target, level, fmt))
        if name:
            lg.propagate = propagate


def _standing_in(described: list) -> list:
    """`described` with the handlers that cannot reach a worker ("other") replaced by one stderr handler (the first
    one's level and format), or by none where the logger writes to stderr already."""
    stand_in = not any(d[0] == "stderr" for d in described)
    kept = []
    for target, level, fmt in described:
        if target == "other" and stand_in:
            kept.append(("stderr", level, fmt))
            stand_in = False
        elif target != "other":
            kept.append((target, level, fmt))
    return kept
