"""The end-of-run export of a reward-model run: `<run>/hf` as a sequence-classification folder.

The folder is the layout `[[rl.rewards]] type = "model"` loads (rl/rewards/score_model.py): the backbone's
tensors under their transformers causal-LM names (no lm_head), `score.weight` [1, hidden], config.json naming
`<Family>ForSequenceClassification` with `num_labels = 1`, and the tokenizer / processor files of `model.path`.
Written as the policy export is: gathered on every rank, written by rank 0 into a temporary folder put in place
with its completion marker once whole, a non-finite tensor refused; a failure on any rank ends the job on every
rank with exit 1 and leaves a previous export intact (training/checkpointing.py).
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Optional

import torch

from megatron_vlm.checkpoint.export import export_dtype
from megatron_vlm.checkpoint.hf import (
    EXPORT_MARKER,
    cast_for_export,
    export_folder,
    replace_dir,
    share_like_umask,
    write_pixel_limits,
)
from megatron_vlm.checkpoint.manager import (
    FAILURES,
    CheckpointError,
    describe_error,
    first_error,
    full_model_state_dict,
    gather_errors,
)
from megatron_vlm.checkpoint.score_folder import write_score_files
from megatron_vlm.finite import check_finite
from megatron_vlm.training.checkpointing import EXIT_SAVE_FAILED, Checkpointer, _fail

__all__ = ["RewardCheckpointer", "export_score_folder"]

log = logging.getLogger("megatron_vlm")


def export_score_folder(state: dict, backbone, out_dir: Path, *, copy_from, dtype: Optional[torch.dtype] = None,
                        pixel_limits: Optional[dict[str, Optional[int]]] = None) -> None:
    """Write the gathered `ScoreRoot` state dict `state` (keys `model.*`, `score.*`) as a reward model folder;
    `dtype` (`checkpoint.export_dtype`): the written weights' (those kept in fp32 on purpose, the score head among
    them, stay fp32);
    `pixel_limits` (the run's `[data]` limits, `data_pixel_limits`): written into its processor configs, so the
    folder sizes images as training did."""
    out_dir = export_folder(out_dir)
    backbone_state = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    score_state = {k[len("score."):]: v for k, v in state.items() if k.startswith("score.")}
    backbone_state = cast_for_export(backbone_state, backbone, dtype)
    # the score head stays fp32 whatever `dtype` (training computes it in fp32, training/reward/model.py `ScoreHead`;
    # the scorer loads it into an fp32 head): rounded, the folder would score other values than training did
    check_finite({**backbone_state, **{f"score.{k}": v for k, v in score_state.items()}},
                 f"refusing to export {out_dir}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = out_dir.parent / f".{out_dir.name}.tmp", out_dir.parent / f".{out_dir.name}.old"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        write_score_files(tmp, backbone, backbone_state, score_state, copy_from=copy_from)
        write_pixel_limits(tmp, **(pixel_limits or {}))
        share_like_umask(tmp)
        replace_dir(tmp, out_dir, old, marker=EXPORT_MARKER, marker_text="reward model export complete\n",
                    is_complete=Path.is_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class RewardCheckpointer(Checkpointer):
    """The run's checkpoints as any job kind's; the final export is a reward model folder."""

    def export_hf(self, out_dir: Path) -> None:
        state = full_model_state_dict(self.wrapper)
        err = None
        if self.is_main and self.cfg.export_hf:
            try:
                export_score_folder(state, self.wrapper.model, out_dir, copy_from=self.model_path,
                                    dtype=export_dtype(self.cfg), pixel_limits=self.pixel_limits)
            except FAILURES as e:  # reported to every rank below
                err = describe_error(e)
        failed = first_error(gather_errors(err))
        if failed is not None:
            _fail(CheckpointError(f"the reward model export to {out_dir} failed on {failed}; a previous export there "
                                  "(if any) is intact"), EXIT_SAVE_FAILED)
        if self.is_main and self.cfg.export_hf:
            log.info("exported the reward model (sequence classification, num_labels 1) to %s", out_dir)
