"""`--set optimizer={lr=1e-4}`: an inline table on a section (a table of the schema) sets the keys it names, as
`--set optimizer.lr=1e-4` does, and the file's other keys of that section stay. It replaced the file's whole table,
so the recipe's betas, train_layers, output_dir ... fell back to their defaults without a word. A key of a field that
holds a table of its own (data.columns, data.chat_template_kwargs), an entry of an array of tables, and `{}` (the
section's defaults) are still replaced whole."""
from __future__ import annotations

from pathlib import Path

from megatron_vlm.config import load_config
from megatron_vlm.config.sections import OptimizerConfig

CONFIGS = Path(__file__).resolve().parents[3] / "launch" / "configs"
SFT, GRPO = CONFIGS / "demo_sft.toml", CONFIGS / "demo_grpo.toml"


def test_a_section_table_sets_its_keys_and_keeps_the_files_others():
    base = load_config(SFT)
    cfg = load_config(SFT, ["optimizer={lr=1e-4}", 'train={max_steps=5, log_every=2}'])
    assert cfg.optimizer.lr == 1e-4 and cfg.optimizer.betas == base.optimizer.betas == (0.9, 0.95)
    assert (cfg.train.max_steps, cfg.train.log_every) == (5, 2)
    assert (cfg.train.output_dir, cfg.train.train_layers) == (base.train.output_dir, base.train.train_layers)


def test_nested_section_tables_and_the_switch_rules_apply_per_key():
    base = load_config(GRPO)
    cfg = load_config(GRPO, ["rl={batch={group_size=3}}"])
    assert cfg.rl.batch.group_size == 3 and cfg.rl.batch.prompts_per_step == base.rl.batch.prompts_per_step
    assert cfg.rl.rewards == base.rl.rewards
    cfg = load_config(SFT, ["checkpoint={enable=false}"])  # as --set checkpoint.enable=false: drops every_steps
    assert not cfg.checkpoint.enable and cfg.checkpoint.every_steps == 0


def test_fields_holding_tables_entries_and_empty_tables_are_replaced():
    cfg = load_config(SFT, ['data.chat_template_kwargs={a=1}', 'data.chat_template_kwargs={b=2}'])
    assert cfg.data.chat_template_kwargs == {"b": 2}
    assert load_config(SFT, ["optimizer={}"]).optimizer == OptimizerConfig()
    cfg = load_config(GRPO, ["rl.rewards[0]={type = 'format', weight = 0.25}"])
    assert (cfg.rl.rewards[0].type, cfg.rl.rewards[0].weight) == ("format", 0.25)


def test_the_slurm_script_finds_an_output_dir_given_in_a_train_table(tmp_path):
    """launch/slurm/train.sbatch picks the run folder before torchrun starts (resolve_output_dir.py): the same folder
    as the loader's for `--set train={output_dir=...}`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("resolve_output_dir", CONFIGS.parent / "slurm" / "resolve_output_dir.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sets = ["--set", f'train={{output_dir="{tmp_path / "x"}", max_steps=3}}']
    assert mod.resolve_output_dir(str(SFT), sets) == str(tmp_path / "x")
    assert load_config(SFT, [sets[1]]).train.output_dir == str(tmp_path / "x")
    # `train={}` replaces the section: the file's output_dir is gone for the loader, so the script sets none either
    # (train.sbatch then gives the job its own runs/<name>-<id>/ folder and passes it on)
    sets = ["--set", f'train.output_dir="{tmp_path / "y"}"', "--set", "train={}"]
    assert mod.resolve_output_dir(str(SFT), sets) is None
