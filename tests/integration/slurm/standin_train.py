"""A tiny stand-in for launch/pretrain_vlm.py with the same outside behaviour, for the Slurm tests.

It keeps the contract train.sbatch relies on — `--config x.toml [--set k=v ...]`, torchrun or plain
python, `[train] output_dir` holding `config.toml`, `metrics_train.csv` and
`checkpoints/step_<N>/` (with a `COMPLETE` marker), `[checkpoint] resume = "auto"`, and SIGTERM ->
every rank agrees at a step boundary, saves a checkpoint, exits 143 — while training a two-layer
MLP in seconds. The launcher tests use it where the real entry point would make them slow, and it
let them run before the entry point existed.

Data parallelism is exact by construction: step `s` draws one global batch from a generator
seeded with (seed, s), each rank takes its slice, and the loss is each rank's sum divided by the
global batch size, with gradients summed across ranks — so any number of processes computes the
same update as one process (up to float summation order).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import tomllib
from pathlib import Path

import torch
import torch.distributed as dist

DEFAULTS = {
    "train": {"output_dir": "runs/standin", "max_steps": 6, "seed": 0, "global_batch_size": 8},
    "checkpoint": {"resume": "auto", "every_steps": 0},
    "standin": {"step_seconds": 0.0},
}


def load_config(path: str, overrides: list[str]) -> dict:
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    cfg = {sec: dict(vals) for sec, vals in DEFAULTS.items()}
    for sec, vals in raw.items():
        cfg.setdefault(sec, {}).update(vals)
    for item in overrides:
        key, _, text = item.partition("=")
        section, _, name = key.strip().partition(".")
        try:
            value = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = text.strip()
        cfg.setdefault(section, {})[name] = value
    return cfg


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def global_batch(seed: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randn(size, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def latest_checkpoint(root: Path) -> Path | None:
    done = [p for p in root.glob("step_*") if (p / "COMPLETE").is_file()]
    return max(done, key=lambda p: int(p.name.split("_")[1])) if done else None


def save(root: Path, step: int, model, optimizer, rank: int) -> None:
    if rank == 0:
        path = root / f"step_{step}"
        path.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}, path / "state.pt")
        (path / "COMPLETE").write_text(f"step={step}\n")
    if dist.is_initialized():
        dist.barrier()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    stop = {"signum": 0}
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(signum=signum))

    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    if world > 1:
        dist.init_process_group("gloo")
    train = cfg["train"]
    seed, max_steps, batch = train["seed"], train["max_steps"], train["global_batch_size"]
    if batch % world:
        raise SystemExit(f"train.global_batch_size={batch} is not divisible by the {world} processes")
    out = Path(train["output_dir"])
    ckpt_root = out / "checkpoints"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text("".join(f"[{s}]\n" + "".join(f"{k} = {v!r}\n" for k, v in vals.items())
                                                 for s, vals in cfg.items()).replace("'", '"'))

    model = build_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = 0
    resume = latest_checkpoint(ckpt_root) if cfg["checkpoint"]["resume"] == "auto" else None
    if resume is not None:
        state = torch.load(resume / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        start = state["step"]
        print(f"Resumed from checkpoint: step={start} ({resume})", flush=True)

    per_rank = batch // world
    every = cfg["checkpoint"]["every_steps"]
    for step in range(start + 1, max_steps + 1):
        x, y = global_batch(seed, step, batch)
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).sum() / batch
        loss.backward()
        total = loss.detach().clone()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
            dist.all_reduce(total)
        optimizer.step()
        if rank == 0:
            metrics = out / "metrics_train.csv"
            if not metrics.exists():
                metrics.write_text("step,loss,world_size\n")
            with open(metrics, "a") as f:
                f.write(f"{step},{total.item():.8f},{world}\n")
            print(f"step {step}/{max_steps} loss {total.item():.6f}", flush=True)
        time.sleep(cfg["standin"]["step_seconds"])
        flag = torch.tensor([stop["signum"]])
        if world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            if rank == 0:  # the message launch/pretrain_vlm.py logs
                print(f"stop signal received: saving a checkpoint at step {step} and exiting", flush=True)
            save(ckpt_root, step, model, optimizer, rank)
            return 143
        if (every and step % every == 0) or step == max_steps:
            save(ckpt_root, step, model, optimizer, rank)
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
