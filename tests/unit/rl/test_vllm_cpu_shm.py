"""The CPU tensor-parallel engines' shared-memory leftovers (inference/vllm_cpu_shm.py `sweep_stale`): an engine
starting removes the segments of this package's engines that no live engine holds (a killed or crashed job's) and
that are older than a minute, and never one a live engine holds, a young one (being set up) or another program's."""
import os
import secrets
import time

from megatron_vlm.inference.vllm_cpu_shm import ENGINE_PREFIX, SHM_DIR, EngineSegments, release, sweep_stale


def _segment(name: str, *, age_s: float):
    path = SHM_DIR / name
    path.write_bytes(b"\0" * 4096)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def test_only_unheld_old_segments_of_our_engines_are_swept():
    tag = secrets.token_hex(6)
    stale = _segment(f"{ENGINE_PREFIX}{tag}-tp:0-[0-1]-cpushm_0", age_s=120)
    live = _segment(f"{ENGINE_PREFIX}{tag}-tp:0-[0-1]-cpushm_1", age_s=120)
    young = _segment(f"{ENGINE_PREFIX}{tag}-tp:0-[2-3]-cpushm_0", age_s=0)
    other = _segment(f"x{tag}-tp:0-[0-1]-cpushm_0", age_s=120)
    held = EngineSegments()
    held.hold(live.name)  # a live engine's: held from its start to its close
    try:
        removed = sweep_stale(min_age_s=60)
        assert stale.name in removed and not stale.exists()
        assert live.exists() and young.exists() and other.exists()
        assert not {live.name, young.name, other.name} & set(removed)
        release(held)  # the engine closes: its segment goes with it
        assert not live.exists() and held.names == []
    finally:
        for p in (stale, live, young, other):
            p.unlink(missing_ok=True)
