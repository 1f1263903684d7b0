"""Pipeline stages (`parallel.pp`, megatron_vlm/parallel/pipeline.py) without a process group: the layer
split, the size errors (exit 2, naming the key and the numbers), the keys refused with pp > 1, and each
stage's part of a real tiny model — its parameters are a partition of the model's (a tied lm_head held by
both end stages), and chaining the stages' forwards in one process gives the one-stage token log-probs."""
from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.checkpoint.manager import restore_param_groups_by_name
from megatron_vlm.config import ConfigError, load_config
from megatron_vlm.config.mode_keys import check_keys_for_mode
from megatron_vlm.config.sections import ParallelConfig
from megatron_vlm.parallel.mesh import LayoutError, build_mesh
from megatron_vlm.parallel.pipeline import (
    PipelineRunner,
    check_pipeline_layout,
    split_model_for_stage,
    stage_layer_range,
)
from megatron_vlm.plan.check import run_check
from megatron_vlm.testing.synthesize import synthesize_model_folder
from megatron_vlm.training.lm_loss import TokenLogprobModel

CONFIGS = Path(__file__).resolve().parents[3] / "launch" / "configs"


@pytest.mark.parametrize("layers,pp", [(2, 2), (5, 2), (7, 3), (36, 4), (3, 3)])
def test_stage_layer_range_partitions_the_layers(layers, pp):
    ranges = [stage_layer_range(layers, pp, s) for s in range(pp)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [hi - lo for lo, hi in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


class _Fake(nn.Module):
    """The parts of a family model the layout check reads: decoder layers, final norm, embedding, lm_head."""

    def __init__(self, layers: int, deepstack: int = 0):
        super().__init__()
        self.language_model = nn.Module()
        self.language_model.embed_tokens = nn.Embedding(4, 2)
        self.language_model.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(layers))
        self.language_model.norm = nn.LayerNorm(2)
        self.lm_head = nn.Linear(2, 4, bias=False)
        self.args = SimpleNamespace(vision=SimpleNamespace(deepstack_visual_indexes=list(range(deepstack))))

    def _input_embeddings(self):
        return self.language_model.embed_tokens


def _fake(layers: int, deepstack: int = 0):
    return _Fake(layers, deepstack)


def test_size_errors_name_the_key_and_numbers():
    with pytest.raises(LayoutError, match=r"parallel.pp \(4\) is larger than the number of decoder layers \(2\)"):
        check_pipeline_layout(_fake(2), ParallelConfig(pp=4), 4)
    with pytest.raises(LayoutError, match=r"parallel.pp \(2\) must divide the number of processes \(3\)"):
        check_pipeline_layout(_fake(4), ParallelConfig(pp=2), 3)
    with pytest.raises(LayoutError, match=r"first stage holds 1 of the 2 decoder layers.*DeepStack.*first 2"):
        check_pipeline_layout(_fake(2, deepstack=2), ParallelConfig(pp=2), 2)
    check_pipeline_layout(_fake(4, deepstack=2), ParallelConfig(pp=2), 2)  # fits: no error
    with pytest.raises(LayoutError, match=r"parallel.pp \(2\) must be >= 1 and divide the number of processes \(3\)"):
        build_mesh(ParallelConfig(pp=2), 3, "cpu")  # refused before any process group is touched
    with pytest.raises(LayoutError, match=r"parallel.dp_shard \(2\) x parallel.tp \(1\) x parallel.pp \(2\) = 4 does not equal the number of processes \(6\)"):
        build_mesh(ParallelConfig(pp=2, dp_shard=2), 6, "cpu")
    for key in ("tp", "cp", "ep"):
        with pytest.raises(ValueError, match=rf"pp: pipeline parallelism \(pp = 2\).*{key} = 2 must be 1"):
            ParallelConfig(pp=2, **{key: 2}).validate()
    with pytest.raises(ValueError, match=r"pp: must be >= 1, got 0"):
        ParallelConfig(pp=0).validate()


def test_keys_refused_with_pp():
    grpo = load_config(CONFIGS / "demo_grpo.toml", ["parallel.pp=2"])
    with pytest.raises(ConfigError, match=r"parallel.pp: .*train.mode = \"sft\" only"):
        check_keys_for_mode(grpo)
    sft = load_config(CONFIGS / "demo_sft.toml", ["parallel.pp=2"])  # synthetic data with a held-out split
    with pytest.raises(ConfigError, match=r"parallel.pp: held-out evaluation .*synthetic_eval_size = 0"):
        check_keys_for_mode(sft)
    one_micro = load_config(CONFIGS / "demo_sft.toml", ["parallel.pp=2", "data.synthetic_eval_size=0"])
    with pytest.raises(ConfigError, match=r"^train.micro_batches_per_step: 1 is fewer than parallel.pp \(2\)"):
        check_keys_for_mode(one_micro)  # the job's PipelineRunner refuses it too; --check finds it first
    check_keys_for_mode(load_config(CONFIGS / "demo_sft.toml", ["parallel.pp=2", "data.synthetic_eval_size=0",
                                                                "train.micro_batches_per_step=2"]))


def test_check_refuses_more_stages_than_layers(tmp_path):
    folder = synthesize_model_folder("tiny_qwen2_5_vl", tmp_path / "m")
    cfg = load_config(CONFIGS / "demo_sft.toml", [f'model.path="{folder}"', "parallel.pp=8",
                                                  "data.synthetic_eval_size=0", "train.micro_batches_per_step=8"])
    out, err = io.StringIO(), io.StringIO()
    code = run_check(cfg, world_size=8, device_memory_gib=80.0, out=out, err=err)
    assert code == 2 and err.getvalue().startswith("check failed: parallel.pp:"), err.getvalue()
    assert "larger than the number of decoder layers (2)" in err.getvalue()


def _batch(vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, 23), generator=g)
    labels = torch.randint(3, vocab, (1, 23), generator=g)
    labels[0, ::4] = -100
    return {"input_ids": ids, "cu_seqlens": torch.tensor([0, 9, 23], dtype=torch.int32), "labels": labels}


@pytest.mark.parametrize("name", ["tiny_qwen2_5_vl", "tiny_nemotron_vl"])
def test_stages_partition_the_model_and_chain_to_the_full_logprobs(tmp_path, name):
    folder = synthesize_model_folder(name, tmp_path / name)
    full = TokenLogprobModel(load_hf_model(folder, dtype=torch.float32, device="cpu")).train()
    names = {n for n, _ in full.named_parameters()}
    tied = full.model.lm_head.weight is full.model._input_embeddings().weight
    batch = _batch(full.model.lm_head.weight.shape[0])
    ref = full(batch)
    stages, held = [], []
    for s in range(2):
        model = load_hf_model(folder, dtype=torch.float32, device="cpu")
        stage = split_model_for_stage(model, TokenLogprobModel, stage=s, pp=2, max_tokens=32, act_dtype=torch.float32)
        stages.append(stage.train())
        held.append({n for n, _ in stage.named_parameters(remove_duplicate=False)})
    assert held[0] | held[1] >= names and held[0] and held[1]
    shared = held[0] & held[1]
    # a tied weight keeps both of its names on the last stage, the embedding's first (its optimizer state's name
    # in a one-stage checkpoint, which a pp run then resumes)
    embed_name = "model.language_model.embed_tokens.weight"
    assert shared == ({"model.lm_head.weight", embed_name} if tied else set()), shared
    if tied:
        assert next(n for n, p in stages[1].named_parameters() if p is stages[1].model.lm_head.weight) == embed_name
    n_layers = len(full.model.language_model.layers)
    assert not any(n.startswith(f"model.language_model.layers.{n_layers - 1}.") for n in held[0])
    assert not any(n.startswith("model.language_model.layers.0.") for n in held[1])
    assert all(n.startswith(("model.language_model.layers.", "model.language_model.norm", "model.lm_head."))
               or n == embed_name for n in held[1]), sorted(held[1])
    for st in stages:
        st.loss_scale, st.logp_sums = 1.0, []
    act = stages[0](torch.zeros(1), batch=batch)
    assert act.shape == (32, act.shape[-1]) and not act[23:].any()  # padded to max_tokens rows
    loss = stages[1](act, batch=batch)
    torch.testing.assert_close(loss, -ref.sum().reshape(1), rtol=1e-6, atol=1e-5)
    # the gradient reaches the first stage through the sent activation
    loss.backward()
    assert act.requires_grad
    with pytest.raises(RuntimeError, match="SFT training steps only"):
        stages[0](batch)


def test_fewer_micro_batches_than_stages_is_a_config_error():
    """1F1B needs a micro-batch per stage: exit 2 naming the key (LayoutError), before any stage is built, not
    torch's ValueError from inside the schedule."""
    with pytest.raises(LayoutError, match=r"train.micro_batches_per_step \(1\) must be at least parallel.pp \(2\)"):
        PipelineRunner(SimpleNamespace(num_stages=2), None, torch.device("cpu"), 1)


def test_a_stage_without_trainable_parameters_is_refused():
    """Every stage's ranks step their own optimizer: a stage that train.train_layers leaves frozen (a projector-only
    run split over stages) is a config error on every rank alike, naming the stage, not one rank's 'no trainable
    parameters left' while the other stages wait."""
    model = _fake(4)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("language_model.layers.0."))
    with pytest.raises(LayoutError, match=r"parallel.pp \(2\): pipeline stage 1 \(decoder layers 2-3\) holds no trainable"):
        check_pipeline_layout(model, ParallelConfig(pp=2), 2)
    model.lm_head.weight.requires_grad_(True)  # the last stage's head
    check_pipeline_layout(model, ParallelConfig(pp=2), 2)
    model.lm_head.weight.requires_grad_(False)
    model.lm_head.weight = model.language_model.embed_tokens.weight  # tied: held by the first and last stage
    for p in model.parameters():
        p.requires_grad_(False)
    model.lm_head.weight.requires_grad_(True)
    check_pipeline_layout(model, ParallelConfig(pp=2), 2)
    with pytest.raises(LayoutError, match=r"pipeline stage 1 \(decoder layers 2-2\)"):
        check_pipeline_layout(model, ParallelConfig(pp=3), 3)  # the middle stage holds neither copy


def test_optimizer_groups_of_the_stages_merge_by_hyperparameters(monkeypatch):
    """A stage without the decayed (or the non-decayed) group (train.train_layers; the optimizer drops empty groups)
    used to fail every checkpoint save ('different optimizer param groups'); the saved groups are now those of all
    stages merged by their hyperparameters, and each stage gets its own groups back with theirs at load."""
    from megatron_vlm.parallel import pipeline

    stage0 = [{"lr": 1e-3, "weight_decay": 0.1, "params": ["m.layers.0.mlp.w"]},
              {"lr": 1e-3, "weight_decay": 0.0, "params": ["m.layers.0.norm.weight"]}]
    stage1 = [{"lr": 1e-3, "weight_decay": 0.1, "params": ["m.lm_head.weight"]}]  # decayed only

    def gather(parts, obj, group=None):  # the two stages' groups, as all_gather_object over the pp group
        sds = [stage0, stage1]
        for s in range(2):
            parts[s] = [({k: v for k, v in g.items() if k != "params"}, list(g["params"])) for g in sds[s]]

    monkeypatch.setattr(pipeline.dist, "all_gather_object", gather)
    me = SimpleNamespace(num_stages=2, pp_group=None, tied=False)
    saved = pipeline.PipelineStageModel.optim_state_dict_for_save(me, {"param_groups": [dict(g) for g in stage1]})
    assert saved["param_groups"] == [
        {"lr": 1e-3, "weight_decay": 0.1, "params": ["m.layers.0.mlp.w", "m.lm_head.weight"]},
        {"lr": 1e-3, "weight_decay": 0.0, "params": ["m.layers.0.norm.weight"]}]
    for own in (stage0, stage1):
        loaded = {"param_groups": [dict(g, params=list(g["params"])) for g in saved["param_groups"]]}
        restore_param_groups_by_name(loaded, [g["params"] for g in own])
        assert loaded["param_groups"] == own


def test_a_stage_with_only_the_undecayed_group_resumes_its_own_weight_decay(tmp_path):
    """Through a real DCP save and load (the manager's): DCP fills the template's param groups by position, so a
    stage holding only the non-decayed group (e.g. norms trained, `train.train_layers`) used to get the first saved
    group back, the decayed one (weight decay 0.1 on its norms). The stage's template now has every saved group and
    takes its own by name."""
    from torch import nn

    from megatron_vlm.checkpoint.manager import CheckpointManager

    class Whole(nn.Module):  # a one-stage run: the decayed weight and both norms
        def __init__(self):
            super().__init__()
            self.w, self.n0, self.n1 = nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))

    class LastStage(nn.Module):  # a pipeline stage holding only the second norm
        def optim_state_dict_for_save(self, optim_sd):  # marks a pipeline stage for the manager
            return optim_sd

        def __init__(self):
            super().__init__()
            self.n1 = nn.Parameter(torch.ones(2))

    def step(model, groups):
        opt = torch.optim.AdamW(groups, lr=1e-3)
        sum(p.sum() for p in model.parameters()).backward()
        opt.step()
        return opt

    whole = Whole()
    opt = step(whole, [{"params": [whole.w], "weight_decay": 0.1}, {"params": [whole.n0, whole.n1], "weight_decay": 0.0}])
    mgr = CheckpointManager(tmp_path, keep_last=0, rank=0)
    path = mgr.save(1, whole, opt, extra={})
    stage = LastStage()
    stage_opt = step(stage, [{"params": [stage.n1], "weight_decay": 0.0}])
    mgr.load(path, stage, stage_opt)
    assert [g["weight_decay"] for g in stage_opt.param_groups] == [0.0]
    assert len(stage_opt.param_groups) == 1 and stage_opt.param_groups[0]["params"] == [stage.n1]


def test_a_one_stage_run_resumes_a_pipeline_checkpoint_without_weight_decay(tmp_path):
    """`optimizer.weight_decay = 0`: a pipeline checkpoint merges the stages' groups by hyperparameters, and the
    decayed and undecayed groups have the same ones, so it holds one group where a one-stage optimizer has two; the
    resume failed in DCP ("Missing key in checkpoint state_dict: optim.param_groups.1.weight_decay"). Through a real
    DCP save and load: each group back with its parameters' saved moments."""
    from megatron_vlm.checkpoint.manager import CheckpointManager

    class Whole(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.n = nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(2))

    def step(model, groups):
        opt = torch.optim.AdamW(groups, lr=1e-3)
        sum((p * p).sum() for p in model.parameters()).backward()
        opt.step()
        return opt

    saved_model = Whole()  # what the merged pipeline groups look like: one group, weight decay 0
    saved_opt = step(saved_model, [{"params": [saved_model.w, saved_model.n], "weight_decay": 0.0}])
    path = CheckpointManager(tmp_path, keep_last=0, rank=0).save(1, saved_model, saved_opt, extra={})
    model = Whole()
    opt = step(model, [{"params": [model.w], "weight_decay": 0.0}, {"params": [model.n], "weight_decay": 0.0}])
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    CheckpointManager(tmp_path, keep_last=0, rank=0).load(path, model, opt)
    assert [g["params"] for g in opt.param_groups] == [[model.w], [model.n]]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.0]
    for mine, theirs in ((model.w, saved_model.w), (model.n, saved_model.n)):
        assert torch.equal(mine, theirs)
        assert torch.equal(opt.state[mine]["exp_avg_sq"], saved_opt.state[theirs]["exp_avg_sq"])
