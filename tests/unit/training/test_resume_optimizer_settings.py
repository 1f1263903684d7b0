"""A resume takes the optimizer moments from the checkpoint but the settings from the current config.

torch's `Optimizer.load_state_dict` copies every param group's hyperparameters out of the checkpoint, so a run
resumed with another `optimizer.weight_decay`, `optimizer.betas`, `optimizer.eps`, or PPO critic `rl.critic.lr`
(a constant lr, no scheduler) silently went on with the values it was saved with. Checked against a fresh torch
AdamW built with the new settings: its first update from the checkpoint's moments is the resumed run's.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace as NS

import torch

from megatron_vlm.config.sections import OptimizerConfig
from megatron_vlm.training.checkpointing import Checkpointer
from megatron_vlm.training.optim import build_optimizer


def _checkpointer(run_dir, opt_cfg: OptimizerConfig, critic_lr: float) -> Checkpointer:
    torch.manual_seed(0)
    model, critic = torch.nn.Linear(4, 3), torch.nn.Linear(4, 1)
    opt = build_optimizer(model, opt_cfg, "cpu")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=critic_lr)
    cfg = NS(checkpoint=NS(enable=True, every_steps=1, keep_last=0, resume="auto", export_hf=False),
             model=NS(path=str(run_dir / "model")))
    ctx = NS(cfg=cfg, env=NS(is_main=True, rank=0), run_dir=run_dir)
    return Checkpointer(ctx, model, NS(optimizer=opt, scheduler=sched), modules={"critic": (critic, critic_opt)})


def _train_step(ck: Checkpointer) -> None:
    x = torch.randn(2, 4)
    ck.wrapper(x).pow(2).sum().backward()
    ck.modules["critic"][0](x).sum().backward()
    for opt in (ck.optim.optimizer, ck.modules["critic"][1]):
        opt.step()
        opt.zero_grad()
    ck.optim.scheduler.step()


def test_changed_optimizer_settings_are_honoured_on_resume_and_logged(tmp_path, caplog):
    old = OptimizerConfig(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    new = OptimizerConfig(lr=1e-2, weight_decay=0.0, betas=(0.8, 0.9), eps=1e-6)
    first = _checkpointer(tmp_path, old, critic_lr=1e-3)
    _train_step(first)
    first.save(1, {})
    resumed = _checkpointer(tmp_path, new, critic_lr=5e-4)
    with caplog.at_level(logging.WARNING, logger="megatron_vlm"):
        assert resumed.resume().step == 1
    decay, no_decay = resumed.optim.optimizer.param_groups
    assert decay["weight_decay"] == 0.0 and no_decay["weight_decay"] == 0.0
    assert tuple(decay["betas"]) == (0.8, 0.9) and decay["eps"] == 1e-6
    assert resumed.modules["critic"][1].param_groups[0]["lr"] == 5e-4
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "weight_decay 0.1 -> 0.0" in said and "betas" in said and "eps" in said and "lr 0.001 -> 0.0005" in said

    # the update from the checkpoint's moments equals a fresh torch AdamW's with the new settings
    moments = first.optim.optimizer.state_dict()
    ref_model = torch.nn.Linear(4, 3)
    ref_model.load_state_dict(first.wrapper.state_dict())
    ref = torch.optim.AdamW([{"params": [ref_model.weight], "weight_decay": 0.0}, {"params": [ref_model.bias], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.8, 0.9), eps=1e-6)
    ref.load_state_dict(moments)
    for g in ref.param_groups:
        g.update(betas=(0.8, 0.9), eps=1e-6, weight_decay=0.0)
    torch.manual_seed(1)
    _train_step(resumed)
    torch.manual_seed(1)
    ref_model(torch.randn(2, 4)).pow(2).sum().backward()
    ref.step()
    torch.testing.assert_close(resumed.wrapper.weight, ref_model.weight, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(resumed.wrapper.bias, ref_model.bias, rtol=1e-6, atol=1e-7)


def test_unchanged_settings_resume_silently(tmp_path, caplog):
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    first = _checkpointer(tmp_path, cfg, critic_lr=1e-3)
    _train_step(first)
    first.save(1, {})
    with caplog.at_level(logging.WARNING, logger="megatron_vlm"):
        _checkpointer(tmp_path, cfg, critic_lr=1e-3).resume()
    assert not [r for r in caplog.records if "settings differ" in r.getMessage()]


def test_checkpoints_off_still_resumes_what_the_folder_holds(tmp_path):
    """`checkpoint.enable = false` stops writes; `checkpoint.resume = "auto"` still does what it says. It used to
    start at step 0 over the folder's checkpoint (the earlier run's metrics rows dropped as steps run again)."""
    cfg = OptimizerConfig(lr=1e-2)
    first = _checkpointer(tmp_path, cfg, critic_lr=1e-3)
    _train_step(first)
    first.save(1, {})
    again = _checkpointer(tmp_path, cfg, critic_lr=1e-3)
    again.cfg.enable = False
    point = again.resume()
    assert point is not None and point.step == 1
    assert torch.equal(again.wrapper.weight, first.wrapper.weight)
    assert not again.periodic_due(1)  # and writes nothing
