"""The launch scripts' command lines: `--help` shows usage and a whole first sentence, a mistyped option is
refused (exit 2) instead of silently doing the default."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.launch_scripts import import_launch_script

REPO = Path(__file__).resolve().parents[2]



def test_convert_checkpoint_help_states_its_whole_first_sentence(capsys):
    conv = import_launch_script("convert_checkpoint")
    with pytest.raises(SystemExit) as e:
        conv.main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage:")
    assert "Convert a distributed training checkpoint to a Hugging Face folder (on demand; runs also export at the end)." in out


def test_gen_config_reference_help_and_a_mistyped_option(capsys, monkeypatch):
    gen = import_launch_script("gen_config_reference")
    monkeypatch.setattr(gen, "render", lambda: "RENDERED\n")  # never touch docs/ from a test
    monkeypatch.setattr(gen, "REFERENCE", Path("/nonexistent/config_reference.md"))
    with pytest.raises(SystemExit) as e:
        gen.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--write" in out and "RENDERED" not in out
    with pytest.raises(SystemExit) as e:
        gen.main(["--wirte"])  # a typo must not print the reference and exit 0 as if the file were rewritten
    assert e.value.code == 2
    assert "RENDERED" not in capsys.readouterr().out
    gen.main([])
    assert capsys.readouterr().out == "RENDERED\n\n"


@pytest.mark.parametrize("mode", ["sft", '"grpo"', "'dpo'"])
def test_evaluate_refuses_a_training_mode_from_the_command_line(mode, capsys):
    """launch/evaluate.py evaluates: a `--set train.mode=<training mode>` must not turn it into a training job
    (its own help says such a mode is refused); exit 2 naming the key, before the config is even read."""
    ev = import_launch_script("evaluate")
    with pytest.raises(SystemExit) as e:
        ev.main(["--config", "/nonexistent.toml", "--set", f"train.mode={mode}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "train.mode" in err and "launch/pretrain_vlm.py" in err and "config file not found" not in err
    # the eval mode itself (redundant but harmless), a later eval winning and other keys go through
    for ok in (['--set', 'train.mode="eval"', "--set=train.max_steps=3"], ["--set", f"train.mode={mode}", "--set=train.mode=eval"]):
        ev._refuse_a_training_mode(["--config", "x.toml", *ok])
    with pytest.raises(SystemExit):
        ev._refuse_a_training_mode(["--config", "x.toml", f"--set=train.mode={mode}"])


def test_evaluate_refuses_a_training_mode_given_in_an_inline_train_table(capsys):
    """`--set 'train={mode="sft", ...}'` sets train.mode too (an inline table sets the keys it names): it turned
    launch/evaluate.py into a training job, after the eval mode the script sets first."""
    ev = import_launch_script("evaluate")
    with pytest.raises(SystemExit) as e:
        ev.main(["--config", "/nonexistent.toml", "--set", 'train={mode="sft", max_steps=3}'])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "train.mode" in err and "launch/pretrain_vlm.py" in err and "config file not found" not in err
    for ok in (['train={max_steps=3}'], ['train={mode="eval"}'], ['train={mode="sft"}', "train.mode=eval"]):
        ev._refuse_a_training_mode(["--config", "x.toml", *[a for item in ok for a in ("--set", item)]])


@pytest.mark.parametrize("name, value", [("WORLD_SIZE", "abc"), ("RANK", "0x"), ("LOCAL_RANK", ""), ("WORLD_SIZE", "0"),
                                         ("RANK", "-1")])
def test_a_bad_launcher_variable_is_an_error_naming_it(name, value, monkeypatch, capsys):
    """A WORLD_SIZE / RANK / LOCAL_RANK that is not a count (set by hand, or by a wrapper script) ended in an
    int() traceback from argparse's default or the process-group set-up; exit 2 naming the variable instead."""
    pretrain = import_launch_script("pretrain_vlm")
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        pretrain.main(["--config", str(REPO / "launch" / "configs" / "demo_sft.toml"), "--check"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: environment variable {name}={value!r}"), err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("world_size, code", [("2", 0), ("0", 2)])
def test_check_under_torchrun_prints_once_and_exits_alike_on_every_rank(world_size, code, monkeypatch, capsys):
    """`torchrun --nproc_per_node N launch/pretrain_vlm.py --check` printed the plan (or the failure) N times,
    interleaved; rank 0 prints it, every rank exits with the same code."""
    pretrain = import_launch_script("pretrain_vlm")
    argv = ["--config", str(REPO / "launch" / "configs" / "demo_sft.toml"), "--check", "--world-size", world_size,
            "--device-memory-gib", "80"]
    printed = []
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        assert pretrain.main(argv) == code
        cap = capsys.readouterr()
        printed.append(cap.out + cap.err)
    assert ("check ok" if code == 0 else "check failed: --world-size") in printed[0]
    assert printed[1] == ""


@pytest.mark.parametrize("script", ["pretrain_vlm", "evaluate"])
def test_a_second_config_is_refused_not_silently_taken_for_the_first(script, capsys):
    """`--config a.toml --config b.toml` ran b alone (argparse keeps the last value), the first file dropped without
    a word (a user layering a base and a change got the change's defaults for everything else); exit 2 naming
    --config, before either file is read."""
    mod = import_launch_script(script)
    with pytest.raises(SystemExit) as e:
        mod.main(["--config", "/nonexistent/a.toml", "--config", "/nonexistent/b.toml"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--config" in err and "config file not found" not in err, err


@pytest.mark.parametrize("flag", ["--se", "--uns", "--conf"])
def test_an_abbreviated_option_is_refused(flag, capsys):
    """argparse took `--se` for `--set` (and `--conf` for `--config`); launch/slurm/resolve_output_dir.py, which picks
    the run folder before the job starts, reads only the whole names, so `--se train.output_dir=/x` trained in /x
    while the Slurm logs and the `finished` marker went to the config's folder. Whole option names only."""
    pretrain = import_launch_script("pretrain_vlm")
    argv = ["--config", str(REPO / "launch" / "configs" / "demo_sft.toml"), "--check", "--device-memory-gib", "80"]
    with pytest.raises(SystemExit) as e:
        pretrain.main([*argv, flag, "train.output_dir=/x" if flag != "--conf" else "/nonexistent.toml"]
                      if flag != "--uns" else [*argv, flag, "train.output_dir"])
    assert e.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err
