"""How a rank starts its DataLoader workers: forked by a fork server, never forked from the rank itself.

Why: a rank runs threads (gloo's, the TensorBoard writer's, torch's) and starts new workers for every
evaluation pass. A child forked while another thread holds a lock can deadlock inside `os.fork()` itself
(CPython's fork-with-threads hazard: the child, still in `PyOS_AfterFork_Child`, waits on a lock whose owner
was not copied), and the rank then waits on that worker for up to `data.loader_timeout_s`. A stress loop of
two gloo ranks with a TensorBoard writer, forking one worker per iteration, hung within 400 iterations in each
of three runs. The fork server is started by fork + exec (safe beside threads), imports the data modules
once, and forks each worker from its one thread: a worker starts in about 0.1 s, where `spawn` would import
torch again (about 2 s each time).

The dataset reaches the worker pickled (a fork copied it), so a dataset must be picklable; `worker_context`
also preloads the modules its pickle names, so that the workers do not import them one by one. A worker runs the
entry script again (as `spawn` does, for the classes a pickle names in `__main__`) only where that is safe, the
code now running in it being under `if __name__ == "__main__":`; an unguarded script's workers start without it, and
a class of its `__main__` in the pickle is an error at loader creation (worker_main.py). Nor does a worker inherit
the rank's later environment or its logging setup: each takes them from the rank in its init (worker_env.py).

A worker is the server's child, not the rank's: torch's own check that its manager lives (the worker's parent pid
changed) cannot see the rank die, and the workers ignore the stop signals. `exit_with_rank` ends a worker whose
rank is gone (killed by the out-of-memory killer or kill -9); the server then ends with its last worker.
"""
from __future__ import annotations

import io
import logging
import multiprocessing as mp
import os
import pickle
import select
import threading
import time
from multiprocessing import forkserver
from multiprocessing.context import BaseContext
from typing import Any, Optional

from megatron_vlm.data.worker_main import MainModuleError, check_main_names, main_script_runs_again, without_main_context

__all__ = ["worker_context", "modules_of", "exit_with_rank", "MainModuleError"]

log = logging.getLogger("megatron_vlm")

_PRELOAD = ("torch", "torch.utils.data._utils.worker", "megatron_vlm.data.loader",
            "megatron_vlm.data.worker_server")
"""Always imported by the server: torch's worker loop, our data pipeline, and the module that makes the server leave
the stop signals to the rank. Not the entry script: the server would run an unguarded one's training code
(worker_main.py); a worker that may run it again does so itself."""


class _ModuleRecorder(pickle.Pickler):
    """A pickler that only notes the module of every class and function it meets."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
        self.modules: set[str] = set()
        self.main_names: set[str] = set()  # "__main__.<qualname>" of each class or function of the entry script

    def reducer_override(self, obj: Any) -> Any:
        owner = obj if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__") else type(obj)
        module = getattr(owner, "__module__", None)
        if isinstance(module, str):
            self.modules.add(module)
            if module in _MAIN:
                self.main_names.add(f"__main__.{getattr(owner, '__qualname__', '?')}")
        return NotImplemented


_MAIN = ("__main__", "__mp_main__")


def _pickle_names(obj: Any) -> tuple[list[str], list[str]]:
    """The modules `obj`'s pickle refers to (sorted; builtins and the entry script left out), and the names it
    refers to in the entry script."""
    recorder = _ModuleRecorder()
    recorder.dump(obj)
    return (sorted(m for m in recorder.modules if m != "builtins" and m not in _MAIN), sorted(recorder.main_names))


def modules_of(obj: Any) -> list[str]:
    """The modules whose classes and functions `obj`'s pickle refers to (sorted; builtins left out)."""
    return _pickle_names(obj)[0]


def _server_running() -> bool:
    return getattr(forkserver._forkserver, "_forkserver_pid", None) is not None


def worker_context(dataset: Any, what: str = "the dataset") -> Optional[BaseContext]:
    """The multiprocessing context for `dataset`'s DataLoader workers: the fork server where the platform has
    one (None, the platform default, elsewhere), whose workers run the entry script again only where that is safe
    (worker_main.py). The first call sets the server's preloads. Raises `MainModuleError` (naming `what`) when the
    pickle needs a class of an entry script that the workers may not run again."""
    if "forkserver" not in mp.get_all_start_methods():
        return None
    try:
        extra, main_names = _pickle_names(dataset)
    except Exception as e:  # the DataLoader's own pickling will say what cannot be pickled
        log.debug("could not list the dataset's modules for the worker server: %s", e)
        extra, main_names = [], []
    runs_again = main_script_runs_again()
    check_main_names(main_names, what, runs_again)
    ctx = mp.get_context("forkserver") if runs_again else without_main_context()
    if not _server_running():
        ctx.set_forkserver_preload([*_PRELOAD, *extra])
    return ctx


def _wait_for_exit(pid: int) -> None:
    """Return once process `pid` has ended (a pidfd where the kernel has them, else a poll each second)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd (not Linux, or a kernel before 5.3)
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(1.0)
    try:
        select.select([fd], [], [])  # readable once the process has ended
    finally:
        os.close(fd)


def exit_with_rank(rank_pid: int) -> None:
    """End this DataLoader worker as soon as its rank (`rank_pid`) ends, when the worker is not the rank's child
    (started by the worker server, see the module docstring): a daemon thread waits for the rank's end."""
    if os.getppid() == rank_pid:  # forked from the rank: torch's own check sees its end
        return

    def watch() -> None:
        _wait_for_exit(rank_pid)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-rank", daemon=True).start()
