"""LR schedule shape, decay groups, train_layers freezing, checkpoint marker logic."""
from __future__ import annotations

import math

import pytest
from torch import nn

from megatron_vlm.checkpoint.manager import MARKER, latest_complete
from megatron_vlm.config.loader import ConfigError
from megatron_vlm.config.sections import OptimizerConfig, SchedulerConfig
from megatron_vlm.training.freeze import apply_train_layers
from megatron_vlm.training.optim import build_optimizer, build_scheduler


class PatchMerger(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Linear(4, 4)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.merger = PatchMerger()
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)


def _lrs(kind, warmup, total, min_ratio=0.0):
    m = nn.Linear(2, 2)
    opt = build_optimizer(m, OptimizerConfig(lr=1.0), "cpu")
    sch = build_scheduler(opt, SchedulerConfig(type=kind, warmup_steps=warmup, min_lr_ratio=min_ratio), total)
    out = []
    for _ in range(total):
        out.append(sch.get_last_lr()[0])
        opt.step()
        sch.step()
    return out


def test_warmup_then_cosine():
    lrs = _lrs("cosine", 4, 20, 0.1)
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    # cosine from 1 at step 4 to 0.1 at step 20
    s = 10
    expect = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 4) / 16))
    assert lrs[s] == pytest.approx(expect)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))


def test_linear_and_constant():
    assert _lrs("linear", 0, 10)[5] == pytest.approx(0.5)
    assert set(_lrs("constant", 2, 10)[2:]) == {1.0}


def test_no_decay_for_biases_and_norms():
    opt = build_optimizer(Toy(), OptimizerConfig(lr=1e-3, weight_decay=0.1), "cpu")
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    m = Toy()
    opt = build_optimizer(m, OptimizerConfig(lr=1e-3, weight_decay=0.1), "cpu")
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert id(m.head.weight) in decayed and id(m.merger.mlp.weight) in decayed
    assert id(m.merger.mlp.bias) not in decayed and id(m.norm.weight) not in decayed


def test_train_layers_by_class_and_regex():
    m = Toy()
    trainable, total = apply_train_layers(m, ["PatchMerger"])
    assert trainable == 4 * 4 + 4 and total == sum(p.numel() for p in m.parameters())
    assert not m.embed.weight.requires_grad and m.merger.mlp.weight.requires_grad
    m = Toy()
    apply_train_layers(m, [r"^head\."])
    assert [n for n, p in m.named_parameters() if p.requires_grad] == ["head.weight"]



def test_train_layers_errors_are_config_errors():
    """Found with the model only, but a config mistake: ConfigError, which the runner turns into exit 2
    and one line (a plain ValueError was a traceback and exit 1 in the job while --check said exit 2)."""
    with pytest.raises(ConfigError, match="match no parameter"):
        apply_train_layers(Toy(), ["Nope"])
    with pytest.raises(ConfigError, match="invalid regex"):
        apply_train_layers(Toy(), ["("])
    m = Toy()
    apply_train_layers(m, ["PatchMerger"])
    for p in m.parameters():
        p.requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        build_optimizer(m, OptimizerConfig(), "cpu")


def test_latest_complete_ignores_partial(tmp_path):
    root = tmp_path / "checkpoints"
    for name, done in [("step_2", True), ("step_10", True), ("step_12", False), (".tmp_step_14", True)]:
        (root / name).mkdir(parents=True)
        if done:
            (root / name / MARKER).write_text("x")
    assert latest_complete(root) == root / "step_10"
    assert latest_complete(tmp_path / "none") is None


def test_total_steps_from_epochs():
    from types import SimpleNamespace

    from megatron_vlm.training.optim import total_steps

    assert total_steps(SimpleNamespace(max_steps=None, epochs=1.5), 10.5) == 16  # ceil(1.5 * 10.5)
    assert total_steps(SimpleNamespace(max_steps=7, epochs=None), 10.5) == 7
    with pytest.raises(ValueError, match="train.epochs"):
        total_steps(SimpleNamespace(max_steps=None, epochs=2.0), None)
