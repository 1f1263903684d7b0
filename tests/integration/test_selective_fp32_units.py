"""`train.activation_checkpointing = "selective"` on Nemotron-H (fp32 routers) under FSDP2 mixed precision.

Each router (`fp32_weight`) is an FSDP2 unit of its own, so that it is gathered in fp32 inside its bf16 block. Inside
a block-wide selective checkpoint its FSDP hooks run different operators in the recomputation than in the forward
(torch 2.13's selective checkpoint counts every dispatched op, FSDP's profiler ranges included), and the first
backward of a one-rank FSDP2 run (one GPU's default in bf16) stopped with "invocation index ... encountered during
backward but not found in storage" (two CPU ranks happened to dispatch the same ops; torch's own fix, which keeps
FSDP's internals out of the replay, came later). The tiny
Nemotron-VL demo job with FSDP2 must train as the same job without FSDP2 units (`parallel.fsdp = false`, where the
block-wide checkpoint holds no hooks), row for row and export for export, and --check must count what it keeps."""
from __future__ import annotations

import torch
from jobs import REPO, load_safetensors_dir, read_metrics, run_job, small_demo_overrides

CONFIG = REPO / "launch" / "configs" / "demo_nemotron_vl.toml"
SETS = {"train.precision": '"bf16"', "train.activation_checkpointing": '"selective"', "train.eval_generate": "false",
        "data.synthetic_eval_size": 0, "train.eval_every": 0, "train.max_steps": 1, "checkpoint.every_steps": 0,
        "logging.console": "false"}


def _job(out, assets, **sets) -> tuple[int, str]:
    """One job in a process of its own: a bf16 FSDP2 job run before it in the same process (another test's, in the
    same pytest worker) moved this one's grad norm in its last digits (6.634350776672363 vs 6.634349822998047)."""
    r = run_job(small_demo_overrides(out, assets, **{**SETS, **sets}), config=CONFIG, check=False)
    return r.returncode, r.stderr


def test_selective_checkpointing_of_fp32_router_blocks_under_fsdp2(tmp_path):
    rows, exports = {}, {}
    for name, fsdp in (("fsdp2", '"auto"'), ("plain", "false")):
        code, err = _job(tmp_path / name, tmp_path / "assets", **{"parallel.fsdp": fsdp})
        assert code == 0, err[-3000:]
        rows[name] = [(r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / name / "metrics_train.csv")]
        exports[name] = load_safetensors_dir(tmp_path / name / "hf")
    assert len(rows["fsdp2"]) == 1 and rows["fsdp2"] == rows["plain"], rows
    a, b = exports["fsdp2"], exports["plain"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
