#!/usr/bin/env python
"""Convert a distributed training checkpoint to a Hugging Face folder (on demand; runs also export
at the end). One process, CPU; reads the run's config.toml next to `checkpoints/` for the model path.

    python launch/convert_checkpoint.py --checkpoint runs/demo_sft/checkpoints/step_100 --out /tmp/hf
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="a checkpoints/step_<N> folder")
    p.add_argument("--out", required=True, help="output Hugging Face folder")
    p.add_argument("--model-path", default=None, help="source HF folder (default: [model] path of the run's config.toml)")
    a = p.parse_args(argv)

    import torch.distributed.checkpoint as dcp

    from megatron_vlm.checkpoint.export import export_hf_from_state_dict
    from megatron_vlm.checkpoint.manager import MARKER
    from megatron_vlm.models import build_model

    ckpt = Path(a.checkpoint)
    if not (ckpt / MARKER).is_file():
        print(f"error: {ckpt} is not a complete checkpoint (no {MARKER} marker)", file=sys.stderr)
        return 2
    model_path = a.model_path
    if model_path is None:
        cfg_file = ckpt.parent.parent / "config.toml"
        if not cfg_file.is_file():
            print(f"error: {cfg_file} not found; pass --model-path", file=sys.stderr)
            return 2
        model_path = tomllib.loads(cfg_file.read_text())["model"]["path"]
    hf_config = json.loads((Path(model_path) / "config.json").read_text())
    model = build_model(hf_config, device="cpu")
    state = {"model": {f"model.{k}": v for k, v in model.state_dict().items()}}
    dcp.load(state, checkpoint_id=str(ckpt))
    sd = {k[len("model."):]: v for k, v in state["model"].items()}
    export_hf_from_state_dict(sd, model_path, a.out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
