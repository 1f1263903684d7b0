"""Checkpoints under faults, in one process with a tiny model: a step is never saved twice, replacing
a complete checkpoint never loses it (crash mid-replace, crash mid-prune, kill -9 remnants restored
at start), files are fsynced before the marker, a full disk fails the save with a clear error and
the previous checkpoint intact, resume falls back past a corrupt newest checkpoint and refuses to
start from 0 silently, `resume = "auto"` with nothing says it starts fresh, and a `checkpoint.resume`
folder owned by another user is refused."""
from __future__ import annotations

import errno
import io
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from megatron_vlm.checkpoint import manager as manager_mod
from megatron_vlm.checkpoint.manager import MARKER, CheckpointManager, list_complete
from megatron_vlm.training.checkpointing import Checkpointer


class Crash(BaseException):
    """Stands for the process dying at that point (not an error the code could handle)."""


def _parts(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    return model, NS(optimizer=opt, scheduler=sched)


def _checkpointer(run_dir: Path, *, resume="auto", keep_last=0, seed=0) -> Checkpointer:
    cfg = NS(checkpoint=NS(enable=True, every_steps=2, keep_last=keep_last, resume=resume, export_hf=False),
             model=NS(path=str(run_dir / "model")))
    ctx = NS(cfg=cfg, env=NS(is_main=True, rank=0), run_dir=run_dir)
    model, optim = _parts(seed)
    return Checkpointer(ctx, model, optim)


def _save(ck: Checkpointer, step: int) -> None:
    with torch.no_grad():
        ck.wrapper.weight.fill_(float(step))  # the weights tell which checkpoint was loaded
    ck.save(step, {"pos": step})


def _ckdir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def test_same_step_is_not_saved_twice(tmp_path, monkeypatch):
    ck = _checkpointer(tmp_path)
    calls = []
    real = manager_mod.dcp.save
    monkeypatch.setattr(manager_mod.dcp, "save", lambda *a, **k: calls.append(k["checkpoint_id"]) or real(*a, **k))
    _save(ck, 2)
    _save(ck, 2)  # the stop signal arriving on a periodic-save step
    assert len(calls) == 1
    assert [s for s, _ in list_complete(_ckdir(tmp_path))] == [2]


def test_crash_while_replacing_a_complete_checkpoint_keeps_it(tmp_path, monkeypatch):
    """A new run (resume = "none", or one that fell back past a corrupt step_4) saves step 4 again:
    the complete step_4 must exist until its replacement is complete."""
    _save(_checkpointer(tmp_path, keep_last=1), 4)
    ck = _checkpointer(tmp_path, keep_last=1, resume="none")
    real_replace, real_rename = os.replace, Path.rename

    def crash_on_tmp(src, dst, real):
        if Path(src).name.startswith(".tmp_step_"):
            raise Crash()
        return real(src, dst)

    monkeypatch.setattr(os, "replace", lambda s, d: crash_on_tmp(s, d, real_replace))
    monkeypatch.setattr(Path, "rename", lambda s, d: crash_on_tmp(s, d, real_rename))
    with pytest.raises(Crash):
        _save(ck, 4)
    monkeypatch.undo()
    resumed = _checkpointer(tmp_path, seed=1)
    point = resumed.resume()
    assert point is not None and point.step == 4
    assert torch.all(resumed.wrapper.weight == 4.0)


def test_kill9_remnants_are_tidied_and_the_complete_checkpoint_restored_at_start(tmp_path):
    """What a SIGKILL in the middle of replacing step_4 leaves: the complete step_4 under its trash
    name, a marker-less step_4 and a temporary folder. The next start puts step_4 back."""
    ck = _checkpointer(tmp_path)
    _save(ck, 2)
    _save(ck, 4)
    root = _ckdir(tmp_path)
    os.replace(root / "step_4", root / ".trash_step_4")
    shutil.copytree(root / ".trash_step_4", root / "step_4")
    (root / "step_4" / MARKER).unlink()
    shutil.copytree(root / "step_2", root / ".tmp_step_6")
    resumed = _checkpointer(tmp_path, seed=1)
    point = resumed.resume()
    assert point.step == 4 and torch.all(resumed.wrapper.weight == 4.0)
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4"]


def test_prune_removes_the_marker_first(tmp_path, monkeypatch):
    ck = _checkpointer(tmp_path, keep_last=1)
    _save(ck, 2)

    def crash(path, *a, **k):
        raise Crash()

    monkeypatch.setattr(manager_mod.shutil, "rmtree", crash)
    with pytest.raises(Crash):
        _save(ck, 4)  # killed while deleting step_2's files
    monkeypatch.undo()
    assert not (_ckdir(tmp_path) / "step_2" / MARKER).exists()  # a half-deleted folder never looks complete
    assert [s for s, _ in list_complete(_ckdir(tmp_path))] == [4]


def test_files_and_folder_are_fsynced_before_the_marker(tmp_path, monkeypatch):
    ck = _checkpointer(tmp_path)
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    _save(ck, 2)
    monkeypatch.undo()
    final = _ckdir(tmp_path) / "step_2"
    marker_at = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(final / MARKER))
    synced_before = {Path(e[1]).name for e in events[:marker_at] if e[0] == "fsync"}
    for f in final.iterdir():
        if f.name != MARKER:
            assert f.name in synced_before, (f.name, synced_before)
    assert ".tmp_step_2" in synced_before  # the folder itself
    assert ("fsync", str(final / MARKER)) in events or any(
        e[0] == "fsync" and Path(e[1]).name.startswith(f".{MARKER}.") and e[1].endswith(".tmp") for e in events)


def test_disk_full_during_save_exits_with_a_clear_error_and_keeps_the_previous(tmp_path, monkeypatch, capsys):
    ck = _checkpointer(tmp_path)
    _save(ck, 2)
    before = {p.name: p.read_bytes() for p in (_ckdir(tmp_path) / "step_2").iterdir()}

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(manager_mod.torch, "save", full)
    with pytest.raises(SystemExit) as e:
        _save(ck, 4)
    monkeypatch.undo()
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "saving checkpoint step_4 failed" in err and "disk full" in err and "step_2 is intact" in err
    root = _ckdir(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["step_2"]  # no temporary folder left behind
    assert {p.name: p.read_bytes() for p in (root / "step_2").iterdir()} == before


@pytest.mark.parametrize("corrupt", ["missing_shard", "garbage_extra"])
def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog, corrupt):
    ck = _checkpointer(tmp_path)
    _save(ck, 2)
    _save(ck, 4)
    step4 = _ckdir(tmp_path) / "step_4"
    if corrupt == "missing_shard":
        for f in step4.glob("*.distcp"):
            f.unlink()
    else:
        (step4 / "extra_rank0.pt").write_bytes(b"not a torch file")
    resumed = _checkpointer(tmp_path, seed=1)
    with caplog.at_level(logging.INFO, logger="megatron_vlm"):
        point = resumed.resume()
    assert point.step == 2 and point.data == {"pos": 2}
    assert torch.all(resumed.wrapper.weight == 2.0)
    assert f"cannot load checkpoint {step4}" in caplog.text and "falling back" in caplog.text


def test_a_checkpoint_that_did_not_load_is_set_aside_not_counted_by_keep_last(tmp_path, caplog):
    """After falling back past a corrupt step_6 to step_4 (keep_last = 2), the corrupt one stayed a complete
    checkpoint: it counted toward keep_last, so the next save kept only one good checkpoint beside it, and every
    later start tried it first."""
    ck = _checkpointer(tmp_path, keep_last=2)
    for step in (2, 4, 6):
        _save(ck, step)
    (_ckdir(tmp_path) / "step_6" / "extra_rank0.pt").write_bytes(b"not a torch file")
    resumed = _checkpointer(tmp_path, keep_last=2, seed=1)
    with caplog.at_level(logging.INFO, logger="megatron_vlm"):
        assert resumed.resume().step == 4
    assert sorted(p.name for p in _ckdir(tmp_path).iterdir()) == [".unloadable_step_6", "step_4"]
    assert "set aside as" in caplog.text
    _save(resumed, 5)  # keep_last = 2: both good checkpoints stay
    assert [n for n, _ in list_complete(_ckdir(tmp_path))] == [4, 5]


def test_no_loadable_checkpoint_is_an_error_not_a_fresh_start(tmp_path, capsys):
    ck = _checkpointer(tmp_path)
    _save(ck, 2)
    for f in (_ckdir(tmp_path) / "step_2").glob("*.distcp"):
        f.write_bytes(b"truncated")
    with pytest.raises(SystemExit) as e:
        _checkpointer(tmp_path, seed=1).resume()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no checkpoint could be loaded" in err and "step_2" in err


def test_auto_resume_without_a_checkpoint_says_it_starts_fresh(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="megatron_vlm"):
        assert _checkpointer(tmp_path).resume() is None
    assert "starting fresh" in caplog.text


def test_resume_path_owned_by_another_user_is_refused(tmp_path, monkeypatch, capsys):
    ck = _checkpointer(tmp_path)
    _save(ck, 2)
    path = _ckdir(tmp_path) / "step_2"
    me = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: me + 1)
    with pytest.raises(SystemExit) as e:
        _checkpointer(tmp_path, resume=str(path), seed=1).resume()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "not by the current user" in err and str(path) in err
    monkeypatch.undo()
    assert _checkpointer(tmp_path, resume=str(path), seed=1).resume().step == 2  # own checkpoint: fine


def test_resume_path_that_is_not_complete_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _checkpointer(tmp_path, resume=str(tmp_path / "nowhere")).resume()
    err = capsys.readouterr().err
    assert e.value.code == 2 and "not a complete checkpoint (it does not exist)" in err


def test_resume_path_of_a_run_folder_names_its_newest_checkpoint(tmp_path, capsys):
    """checkpoint.resume = the run folder or its checkpoints/ folder (a common slip): exit 2 naming the
    newest complete checkpoint under it, not a bare "no COMPLETE marker"."""
    _save(_checkpointer(tmp_path), 2)
    _save(_checkpointer(tmp_path), 4)
    for wrong in (tmp_path, tmp_path / "checkpoints"):
        with pytest.raises(SystemExit) as e:
            _checkpointer(tmp_path, resume=str(wrong)).resume()
        err = capsys.readouterr().err
        assert e.value.code == 2 and "not a complete checkpoint" in err
        assert f"e.g. {tmp_path / 'checkpoints' / 'step_4'}" in err and 'checkpoint.resume = "auto"' in err


def test_rewind_to_an_older_checkpoint_sets_the_abandoned_later_ones_aside(tmp_path):
    """checkpoint.resume = an older step of this run: the later checkpoints belong to the run it abandons; a crash
    of the rewound run before its next save must not make resume = "auto" load them. They are kept under another
    name, never loaded or pruned; a checkpoint named outside this run's folder at a later step moves nothing."""
    for step in (2, 4, 6):
        _save(_checkpointer(tmp_path), step)
    other = tmp_path / "elsewhere"
    _save(_checkpointer(other), 8)
    assert _checkpointer(tmp_path, resume=str(other / "checkpoints" / "step_8")).resume().step == 8
    assert [n for n, _ in list_complete(_ckdir(tmp_path))] == [2, 4, 6]  # another run's checkpoint: nothing moved
    assert _checkpointer(tmp_path, resume=str(_ckdir(tmp_path) / "step_2")).resume().step == 2
    assert [n for n, _ in list_complete(_ckdir(tmp_path))] == [2]
    assert sorted(p.name for p in _ckdir(tmp_path).iterdir() if p.name.startswith(".abandoned")) == [
        ".abandoned_step_4", ".abandoned_step_6"]
    assert all((_ckdir(tmp_path) / f".abandoned_step_{n}" / MARKER).is_file() for n in (4, 6))  # kept whole
    assert _checkpointer(tmp_path).resume().step == 2  # "auto" after a crash: the rewound run's own newest
    _checkpointer(tmp_path).manager.cleanup()  # start-of-run tidying leaves them alone
    assert (_ckdir(tmp_path) / ".abandoned_step_6").is_dir()


def test_the_same_command_started_again_after_a_kill_keeps_the_first_attempts_checkpoints(tmp_path, caplog):
    """checkpoint.resume = another run's step_2: the first attempt saved step_4 and step_6 here, then was killed; the
    same command started again loads step_2 again, as it says. The first attempt's later checkpoints used to stay
    under their names: overwritten one by one as the new attempt saves, or loaded by resume = "auto" after a
    crash in place of the new attempt's own (another lineage). They are set aside whole, and the log says how to
    continue them instead."""
    import logging

    base = tmp_path / "base"
    _save(_checkpointer(base), 2)
    start = str(_ckdir(base) / "step_2")
    run = tmp_path / "run"
    assert _checkpointer(run, resume=start).resume().step == 2  # the first attempt
    for step in (4, 6):
        _save(_checkpointer(run, resume=start), step)
    with caplog.at_level(logging.WARNING):
        assert _checkpointer(run, resume=start).resume().step == 2  # started again after a kill
    assert list_complete(_ckdir(run)) == []
    assert all((_ckdir(run) / f".abandoned_step_{n}" / MARKER).is_file() for n in (4, 6))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert ".abandoned_step_6" in said and 'checkpoint.resume = "auto"' in said
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert _checkpointer(run).resume() is None  # "auto" now: nothing of the abandoned attempt, and it says so
    assert ".abandoned_step_4, .abandoned_step_6" in " ".join(r.getMessage() for r in caplog.records)


def test_manager_error_names_the_failing_phase(tmp_path, monkeypatch):
    """The library raises `CheckpointError` (the Checkpointer turns it into the exit)."""
    from megatron_vlm.checkpoint.manager import CheckpointError

    model, optim = _parts()
    mgr = CheckpointManager(tmp_path, keep_last=0, rank=0)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(manager_mod, "replace_dir", full)
    with pytest.raises(CheckpointError, match="while committing on rank 0: OSError.*disk full"):
        mgr.save(2, model, optim.optimizer, {})
    assert list_complete(tmp_path / "checkpoints") == []


def test_a_module_state_this_run_does_not_train_is_named_at_resume(tmp_path, caplog):
    """A checkpoint with a module's state beside the model's (PPO's critic) resumed by a run without that module
    (rl.advantage = "grpo") loads the model and says the critic state is left behind, instead of dropping it
    silently; a run that trains the module loads it without the warning."""
    cfg = NS(checkpoint=NS(enable=True, every_steps=2, keep_last=0, resume="auto", export_hf=False),
             model=NS(path=str(tmp_path / "model")))
    ctx = NS(cfg=cfg, env=NS(is_main=True, rank=0), run_dir=tmp_path)
    model, optim = _parts(0)
    critic, critic_opt = _parts(1)
    Checkpointer(ctx, model, optim, modules={"critic": (critic, critic_opt.optimizer)}).save(2, {"pos": 2})
    for modules, warned in (({}, True), ({"critic": (critic, critic_opt.optimizer)}, False)):
        caplog.clear()
        fresh, fresh_optim = _parts(3)
        with caplog.at_level(logging.WARNING):
            point = Checkpointer(ctx, fresh, fresh_optim, modules=modules).resume()
        assert point is not None and point.step == 2 and torch.equal(fresh.weight, model.weight)
        said = [r.getMessage() for r in caplog.records if "which this run does not train" in r.getMessage()]
        assert bool(said) == warned and (not said or "holds the state of critic" in said[0]), said



class _FullFile(io.RawIOBase):
    """A file on a disk with 1000 bytes left: a write past them raises ENOSPC."""

    def __init__(self):
        super().__init__()
        self.room = 1000

    def writable(self):
        return True

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return len(data)


def test_a_real_disk_full_inside_a_shard_write_is_named_as_such(tmp_path, monkeypatch, capsys):
    """On a full disk DCP's shard write fails inside torch's zip writer, once the file's buffer flushes: the file's
    OSError (ENOSPC) is swallowed into `RuntimeError: [enforce fail at inline_container.cc] . unexpected pos ...`,
    the OSError left only as that error's context. The save's error line showed the cryptic text alone, without the
    documented "(disk full or quota exceeded)" (seen on a full tmpfs). Here torch.save itself makes that error."""
    ck = _checkpointer(tmp_path)
    _save(ck, 2)

    def shard_write_on_a_full_disk(state, *a, **k):
        torch.save(state, _FullFile())

    monkeypatch.setattr(manager_mod.dcp, "save", shard_write_on_a_full_disk)
    with pytest.raises(SystemExit) as e:
        _save(ck, 4)
    monkeypatch.undo()
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "saving checkpoint step_4 failed" in err and "unexpected pos" in err and "step_2 is intact" in err, err
    assert "(disk full or quota exceeded)" in err, err


def test_a_disk_full_error_that_lost_its_oserror_in_transit_is_named_by_the_free_space(tmp_path, monkeypatch, capsys):
    """With a process group (every job has one), DCP sends each rank's error through pickle, which drops the
    RuntimeError's context: the ENOSPC behind torch's "unexpected pos" was gone and the save's line did not say
    the disk was full (seen on a full tmpfs). A failed shard write on a filesystem left without room says so."""
    import pickle

    ck = _checkpointer(tmp_path)
    _save(ck, 2)

    def shard_write_through_a_process_group(state, *a, **k):
        try:
            torch.save(state, _FullFile())
        except RuntimeError as e:
            raise pickle.loads(pickle.dumps(e)) from None  # what DCP's all-gather of the ranks' errors leaves

    real_statvfs = os.statvfs

    def full_statvfs(path):
        st = real_statvfs(path)
        return NS(f_bavail=0, f_frsize=st.f_frsize) if str(tmp_path) in str(path) else st

    monkeypatch.setattr(manager_mod.dcp, "save", shard_write_through_a_process_group)
    monkeypatch.setattr(os, "statvfs", full_statvfs)
    with pytest.raises(SystemExit):
        _save(ck, 4)
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert "unexpected pos" in err and "(disk full or quota exceeded)" in err, err
    _save(ck, 6)  # room: a failure there is not put down to the disk
    capsys.readouterr()

    def broken(state, *a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(manager_mod.dcp, "save", broken)
    with pytest.raises(SystemExit):
        _save(ck, 8)
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert "unexpected pos" in err and "disk full" not in err, err
