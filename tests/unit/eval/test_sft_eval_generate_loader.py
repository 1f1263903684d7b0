"""SFT's generation-based evaluation (`train.eval_generate`) plans its prompt loader once per run.

It used to build the loader at every evaluation: the prompt lengths were estimated again and the records the
planning skips (here a prompt longer than `data.max_tokens_per_pack`, a missing image) were logged again, their
skip counts growing by one per evaluation. The answers scored are the same at every evaluation."""
from __future__ import annotations

from types import SimpleNamespace as NS

import torch

from megatron_vlm.data import loader as loader_mod
from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.config import DataConfig
from megatron_vlm.eval import sft as sft_eval
from tests.unit.eval.bench_harness import AnswerEngine, write_messages, write_png


def test_two_evaluations_plan_the_prompts_once(tmp_path, proc, monkeypatch):
    write_png(tmp_path / "ok.png")
    path = write_messages(tmp_path / "eval.jsonl", [
        ("ok.png", "What colour?", "red"), (None, "What colour is red?", "red"), (None, "Is it blue?", "blue"),
        ("missing.png", "What colour?", "red"), (None, "word " * 400, "red")])  # the last: too long
    data = DataConfig(eval_path=str(path), image_root=str(tmp_path), max_tokens_per_pack=256, num_workers=0)
    ctx = NS(cfg=NS(data=data, train=NS(eval_generate=True, eval_max_batches=0)),
             env=NS(rank=0, world_size=1, is_main=True, device=torch.device("cpu")), device=torch.device("cpu"))
    bundle = NS(processor=proc, dims=NS(dp_rank=0, dp_size=1), wrapper=NS(eval=lambda: None, train=lambda: None))

    planned = []
    real_lengths = loader_mod.compute_lengths_and_classes

    def counting(*args, **kw):
        planned.append(kw.get("for_generation"))
        return real_lengths(*args, **kw)

    monkeypatch.setattr(loader_mod, "compute_lengths_and_classes", counting)
    monkeypatch.setattr(sft_eval, "heldout_loss", lambda *a, **kw: None)  # the packed loss is not the subject here
    monkeypatch.setattr(sft_eval, "answer_engine", lambda ctx, bundle: AnswerEngine("red"))
    bad = BadRecordLog()
    evaluate = sft_eval.SFTEvaluator(ctx, bundle, bad)
    first = evaluate(1)
    skips_after_first = bad.to_dict()
    second = evaluate(2)
    assert planned.count(True) == 1, planned
    assert first == second and first["answer_n"] == 3 and first["answer_accuracy"] == 2 / 3
    assert bad.to_dict() == skips_after_first
    assert sorted((r["index"], r["category"], r["skips"]) for r in bad.to_dict()["records"]) == [
        (4, "missing_image", 1), (5, "too_long", 1)]
