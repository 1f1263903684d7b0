"""A resume whose `model.path` is a model of other sizes than the checkpoint's (same model type: a 7B folder for a
3B run's checkpoints) is refused before any shard is read, naming `model.path`. It used to reach DCP, whose "Size
mismatch" made every checkpoint of the run count as one that could not be loaded, with the advice to "remove or
repair them": good checkpoints, and nothing said that the model folder was the one to change."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from megatron_vlm.config.sections import OptimizerConfig
from megatron_vlm.training.checkpointing import EXIT_RESUME_FAILED, Checkpointer
from megatron_vlm.training.optim import build_optimizer


def _checkpointer(run_dir, model_path: str, width: int) -> Checkpointer:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2))
    opt = build_optimizer(model, OptimizerConfig(lr=1e-2), "cpu")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    cfg = NS(checkpoint=NS(enable=True, every_steps=1, keep_last=0, resume="auto", export_hf=False),
             model=NS(path=model_path))
    ctx = NS(cfg=cfg, env=NS(is_main=True, rank=0), run_dir=run_dir)
    return Checkpointer(ctx, model, NS(optimizer=opt, scheduler=sched))


def _save_one_step(ck: Checkpointer) -> None:
    ck.wrapper(torch.randn(3, 4)).pow(2).sum().backward()
    ck.optim.optimizer.step()
    ck.optim.scheduler.step()
    ck.save(1, {})


def test_a_model_of_other_sizes_is_refused_naming_model_path(tmp_path, capsys):
    _save_one_step(_checkpointer(tmp_path, "/models/small", width=8))
    with pytest.raises(SystemExit) as e:
        _checkpointer(tmp_path, "/models/large", width=16).resume()
    assert e.value.code == EXIT_RESUME_FAILED
    err = capsys.readouterr().err
    assert err.startswith(f"error: model.path: {tmp_path / 'checkpoints' / 'step_1'} was written for a model of other "
                          'sizes (model.path = "/models/small") than this run\'s model.path ("/models/large")'), err
    assert "3 tensor(s) differ, e.g. 0.bias is [8] in the checkpoint and [16] here" in err and "repair" not in err, err


def test_the_same_sizes_resume(tmp_path):
    _save_one_step(_checkpointer(tmp_path, "/models/small", width=8))
    assert _checkpointer(tmp_path, "/models/elsewhere", width=8).resume().step == 1
