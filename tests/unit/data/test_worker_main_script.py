"""A script that builds our loaders need not guard its code with `if __name__ == "__main__":`.

The workers start from the worker server (worker_start.py), which, like `spawn`, ran the entry script again in
each worker (as `__mp_main__`) to find the classes a pickle names there. An unguarded script then ran its training
code again in every worker, up to its own loader, where the worker died ("DataLoader worker exited unexpectedly"
after a liveness slice; a script that joins a process group first would wait there instead). Now the script is run
again only when it is guarded; an unguarded one works whenever its dataset lives in a module, and a dataset class of
an unguarded script's `__main__` is an error at once that says what to do.

Each script runs in a child interpreter with a time limit, so a hang fails the test instead of blocking it."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

_MODULE = textwrap.dedent("""
    import os


    class Items:
        def __getitem__(self, key):
            return {"key": key, "_bad_records": []}


    class Source:
        '''Every record a bad record (no processor needed): the length pass still runs over its workers.'''

        def __len__(self):
            return 600

        def locate(self, i):
            return ("items.jsonl", i)

        def get(self, i):
            raise ValueError("no record here")
""")

_HEAD = textwrap.dedent("""
    import os
    print("TRAINING CODE RAN", flush=True)  # a script's training code: must run once, in the rank only
    from megatron_vlm.data.bad_records import BadRecordLog
    from megatron_vlm.data.loader import EvalDataLoader


    class MainItems:
        def __getitem__(self, key):
            return {"key": key, "_bad_records": []}


    def run(dataset):
        loader = EvalDataLoader(dataset, list(range(3)), num_workers=1, prefetch_factor=2,
                                bad_records=BadRecordLog(), mode="batches", timeout_s=30)
        print("keys", [x["key"] for x in loader], flush=True)
""")


def _run(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess, float]:
    (tmp_path / "user_items.py").write_text(_MODULE)
    script = tmp_path / "train.py"
    script.write_text(_HEAD + textwrap.dedent(body))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=40, cwd=str(tmp_path),
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])})
    return r, time.monotonic() - t0


def test_an_unguarded_script_whose_dataset_lives_in_a_module_works(tmp_path):
    r, _ = _run(tmp_path, """
        from user_items import Items
        run(Items())
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("TRAINING CODE RAN") == 1, r.stdout
    assert "keys [0, 1, 2]" in r.stdout


def test_an_unguarded_script_s_length_pass_works(tmp_path):
    r, _ = _run(tmp_path, """
        from megatron_vlm.data.lengths import compute_lengths
        from user_items import Source
        got = compute_lengths(Source(), None, max_frames=4, num_workers=2)
        print("lengths", len(got), int((got == -1).sum()), flush=True)
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("TRAINING CODE RAN") == 1, r.stdout
    assert "lengths 600 600" in r.stdout


def test_an_unguarded_script_s_own_dataset_class_is_an_error_at_once(tmp_path):
    r, took = _run(tmp_path, """
        run(MainItems())
    """)
    assert r.returncode != 0
    assert r.stdout.count("TRAINING CODE RAN") == 1, r.stdout
    err = r.stderr.splitlines()[-1]
    assert "__main__.MainItems" in err and "module" in err and 'if __name__ == "__main__":' in err, err
    assert "data.num_workers = 0" in err, err
    assert "exited unexpectedly" not in r.stderr
    assert took < 20


def test_a_guarded_script_s_own_dataset_class_reaches_the_workers(tmp_path):
    r, _ = _run(tmp_path, """
        if __name__ == "__main__":
            run(MainItems())
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "keys [0, 1, 2]" in r.stdout
