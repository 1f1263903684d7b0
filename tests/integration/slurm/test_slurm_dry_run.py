"""DRY_RUN=1 of launch/slurm/train.sbatch and bench_kernels.sbatch: the exact per-node commands.

These need no Slurm daemons: the job is described by SLURM_* variables as Slurm would set them.
Expected values come from the torchrun / Slurm conventions the script promises (node rank =
SLURM_NODEID, endpoint = first host of the node list, port 15000 + job id % 15000).
"""
from __future__ import annotations

import subprocess

import pytest
from slurm_helpers import BENCH_SBATCH, ENTRY, TRAIN_SBATCH, clean_env, dry_run, option, set_values, split_node_line


def write_config(folder, text="[train]\nmax_steps = 2\n"):
    path = folder / "job.toml"
    path.write_text(text)
    return path


def job_env(**extra):
    base = dict(SLURM_JOB_ID="31337", SLURM_JOB_NAME="sft", SLURM_NNODES="3",
                SLURM_JOB_NODELIST="gpu-a,gpu-b,gpu-c")
    base.update(extra)
    return clean_env(**base)


def run_script(tmp_path, args, env):
    return subprocess.run(["bash", str(TRAIN_SBATCH), *args], capture_output=True, text=True, cwd=tmp_path, env=env)


def test_one_line_per_node_with_rank_endpoint_and_run_folder(tmp_path):
    config = write_config(tmp_path)
    lines, log = dry_run([str(config), "--set", "train.max_steps=2", "--set", "optimizer.lr=1e-4"],
                         cwd=tmp_path, env=job_env(NPROC_PER_NODE="4"))
    assert len(lines) == 3, lines
    for rank, line in enumerate(lines):
        cwd, argv = split_node_line(line)
        assert cwd == str(tmp_path)
        assert argv[argv.index("-m") + 1] == "torch.distributed.run"
        assert option(argv, "--nnodes") == "3"
        assert option(argv, "--nproc_per_node") == "4"
        assert option(argv, "--node_rank") == str(rank)
        assert option(argv, "--rdzv_backend") == "c10d"
        assert option(argv, "--rdzv_endpoint") == f"gpu-a:{15000 + 31337 % 15000}"
        assert option(argv, "--rdzv_id") == "31337"
        assert argv[argv.index("--config") - 1] == str(ENTRY)
        assert option(argv, "--config") == str(config)
        # the user's overrides in order, then the job's own run folder
        assert set_values(argv) == ["train.max_steps=2", "optimizer.lr=1e-4",
                                    f'train.output_dir="{tmp_path}/runs/sft-31337"']
    assert "3 node(s) x 4 process(es)" in log


@pytest.mark.parametrize(
    "extra, want",
    [
        (dict(SLURM_GPUS_ON_NODE="8"), "8"),
        (dict(SLURM_GPUS_PER_NODE="h100:4"), "4"),
        (dict(SLURM_GPUS_PER_NODE="2"), "2"),
        (dict(SLURM_GPUS_ON_NODE="8", NPROC_PER_NODE="2"), "2"),
        ({}, "1"),  # no GPU or NPU on this machine: one CPU process
    ],
)
def test_processes_per_node_from_the_allocation(tmp_path, extra, want):
    lines, _ = dry_run([str(write_config(tmp_path))], cwd=tmp_path,
                       env=job_env(SLURM_NNODES="1", SLURM_JOB_NODELIST="n1", **extra))
    assert [option(split_node_line(line)[1], "--nproc_per_node") for line in lines] == [want]


def test_bad_device_count_is_an_error_naming_its_source(tmp_path):
    res = run_script(tmp_path, [str(write_config(tmp_path))], job_env(DRY_RUN="1", SLURM_GPUS_PER_NODE="gpu:x"))
    assert res.returncode == 2
    assert "SLURM_GPUS_PER_NODE" in res.stderr and "'x'" in res.stderr


def test_output_dir_from_config_or_set_is_kept(tmp_path):
    # (a table after [train] must not confuse the lookup)
    config = write_config(tmp_path, '[train]\noutput_dir = "shared/run"\nmax_steps = 2\n[optimizer]\nlr = 0.1\n')
    lines, log = dry_run([str(config)], cwd=tmp_path, env=job_env())
    assert all(set_values(split_node_line(line)[1]) == [] for line in lines)
    assert f"run folder {tmp_path}/shared/run" in log

    lines, log = dry_run([str(config), "--set", "train.output_dir=/abs/other"], cwd=tmp_path, env=job_env())
    assert set_values(split_node_line(lines[0])[1]) == ["train.output_dir=/abs/other"]
    assert "run folder /abs/other" in log


def test_a_config_with_a_byte_order_mark_is_read(tmp_path):
    config = tmp_path / "job.toml"
    config.write_bytes(b'\xef\xbb\xbf[train]\noutput_dir = "bom/run"\n')
    _, log = dry_run([str(config)], cwd=tmp_path, env=job_env())
    assert f"run folder {tmp_path}/bom/run" in log


def test_a_blank_output_dir_is_refused_before_any_folder_is_made(tmp_path):
    """The config refuses a whitespace-only train.output_dir; the script used to make a junk log folder under it
    first (the job then failed at start-up)."""
    config = write_config(tmp_path)
    res = run_script(tmp_path, [str(config), "--set", 'train.output_dir="  "'], job_env(DRY_RUN="1"))
    assert res.returncode != 0 and "train.output_dir must be a non-empty string" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.toml"]


def test_a_malformed_quoted_output_dir_is_refused_as_the_entry_point_refuses_it(tmp_path):
    """launch/pretrain_vlm.py refuses a `--set` value that starts as TOML and does not parse; the script took the
    bare text as the run folder (`"runs/x`, quote included) and would have made its log folder there."""
    config = write_config(tmp_path)
    res = run_script(tmp_path, [str(config), "--set", 'train.output_dir="runs/x'], job_env(DRY_RUN="1"))
    assert res.returncode != 0 and "train.output_dir: --set value" in res.stderr, res.stderr
    assert "is not one TOML value" in res.stderr


def test_a_home_folder_in_the_output_dir_is_expanded_as_the_entry_point_expands_it(tmp_path):
    """The entry point expands a leading ~ of train.output_dir; the script made it `<submit dir>/~/...` and wrote the
    job's logs there, away from the run folder."""
    config = write_config(tmp_path)
    home = tmp_path / "home"
    _, log = dry_run([str(config), "--set", "train.output_dir=~/runs/x"], cwd=tmp_path, env=job_env(HOME=str(home)))
    assert f"run folder {home}/runs/x" in log
    config = write_config(tmp_path, '[train]\noutput_dir = "~/runs/y"\n')
    _, log = dry_run([str(config)], cwd=tmp_path, env=job_env(HOME=str(home)))
    assert f"run folder {home}/runs/y" in log


def test_missing_config_node_count_mismatch_and_no_job_are_errors(tmp_path):
    config = write_config(tmp_path)
    res = run_script(tmp_path, ["nope.toml"], job_env(DRY_RUN="1"))
    assert res.returncode == 2 and "config file 'nope.toml' does not exist" in res.stderr
    res = run_script(tmp_path, [str(config)], job_env(DRY_RUN="1", SLURM_NNODES="2"))
    assert res.returncode == 2 and "has 3 hosts but SLURM_NNODES=2" in res.stderr
    res = run_script(tmp_path, [str(config)], clean_env())
    assert res.returncode == 2 and "not inside a Slurm job" in res.stderr


def test_bracketed_node_list_is_expanded_by_scontrol(tmp_path, slurm_cluster):
    env = slurm_cluster.env(**{k: v for k, v in clean_env().items() if k in ("TORCHRUN", "PYTHON")})
    lines, _ = dry_run([str(write_config(tmp_path))], cwd=tmp_path,
                       env={**env, "SLURM_JOB_ID": "7", "SLURM_NNODES": "4", "SLURM_JOB_NODELIST": "node[08-10],login"})
    argvs = [split_node_line(line)[1] for line in lines]
    assert [option(a, "--node_rank") for a in argvs] == ["0", "1", "2", "3"]
    assert {option(a, "--rdzv_endpoint") for a in argvs} == {"node08:15007"}


def test_bench_dry_run_lists_each_benchmark(tmp_path):
    bench = tmp_path / "benches"
    bench.mkdir()
    for name in ("bench_b.py", "bench_a.py", "helper.py"):
        (bench / name).write_text("print('x')\n")
    out = tmp_path / "out"
    lines, _ = dry_run(["--iters", "3"], cwd=tmp_path, env=clean_env(BENCH_DIR=str(bench), BENCH_OUT_DIR=str(out)),
                       script=BENCH_SBATCH)
    argvs = [split_node_line(line)[1] for line in lines]
    # each benchmark writes its own JSON table beside its log
    assert [a[1:] for a in argvs] == [[str(bench / "bench_a.py"), "--iters", "3", "--json", str(out / "bench_a.json")],
                                      [str(bench / "bench_b.py"), "--iters", "3", "--json", str(out / "bench_b.json")]]


@pytest.mark.parametrize("given", [["--json", "t.json"], ["--json=t.json"]])
def test_bench_refuses_one_json_path_for_every_benchmark(tmp_path, given):
    """One --json for all of them left only the last benchmark's table."""
    res = subprocess.run(["bash", str(BENCH_SBATCH), "--quick", *given], capture_output=True, text=True, cwd=tmp_path,
                         env={**clean_env(), "DRY_RUN": "1"}, timeout=60)
    assert res.returncode == 2 and "--json" in res.stderr and "own <bench name>.json" in res.stderr


@pytest.mark.parametrize("extra", [["--config", "other.toml"], ["--config=other.toml"]])
def test_a_second_config_after_the_first_argument_is_refused_before_any_folder_is_made(tmp_path, extra):
    """The config is the script's first argument; a `--config` among the training arguments was passed on to the
    entry point, which read that file instead (argparse keeps the last), while the run folder, its logs and the
    `finished` marker came from the first: exit 2 at once, as the entry point now refuses a second --config."""
    config = write_config(tmp_path, '[train]\noutput_dir = "first/run"\nmax_steps = 2\n')
    (tmp_path / "other.toml").write_text('[train]\noutput_dir = "second/run"\nmax_steps = 2\n')
    res = run_script(tmp_path, [str(config), *extra], job_env(DRY_RUN="1"))
    assert res.returncode == 2, res.stderr
    assert "--config" in res.stderr and "first argument" in res.stderr, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.toml", "other.toml"]
