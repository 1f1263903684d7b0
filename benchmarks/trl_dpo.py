"""DPO step time: ours (`[train] mode = "dpo"`) vs TRL's `DPOTrainer` on the same tiny Qwen2 model, weights and pairs.

Why: TRL is what users would otherwise run for DPO; the figure to beat is the wall time of one optimizer step
(policy forward and backward over chosen and rejected, the frozen reference's log-probs, clip, AdamW) at equal
data. Setup: a tiny Qwen2 folder (`testing.tiny_text_model`, random weights) loaded by transformers
(`Qwen2ForCausalLM`, SDPA attention) for TRL and by our loader for us; `--pairs` preference pairs of random
token ids (a prompt of `--prompt-len` tokens, chosen and rejected responses of `--response-len` tokens each),
the same ids for both (TRL: its tokenisation step is skipped, the rows go to its own collator as
`prompt_ids` / `chosen_ids` / `rejected_ids`); sigmoid DPO, beta 0.1, the reference the frozen initial model.
Each framework runs its default path: TRL pads the 2 x pairs rows of [chosen; rejected] (its collator), scores
them with its fused log-prob head, gradient checkpointing on (its default), and the reference log-probs of
every batch by a forward of a second model copy (`precompute_ref_log_probs = False`, its default); ours is the
real `DPOStep` as `launch/pretrain_vlm.py` builds it (`build_model_bundle`, `build_reference` with
`dpo.reference = "on_the_fly"`: a frozen copy scoring every pack), every pair's chosen and rejected in one
packed varlen forward with their prompt computed once (training/pair_prompts.py; `--prompt-sharing off`: the
prompt in both sequences, the layout before); one fp32 CPU process keeps plain parameters as a job does (`--fsdp on`: FSDP2 units on a
one-rank mesh anyway). Both fp32, gradient clipping at 1.0, their default AdamW, lr 1e-6 (TRL's DPO default).

Same loss: the first steps' losses and summed log-probs of both are printed side by side (step 1 scores the
initial weights, where the loss is log 2 for any data; the log-probs and the later steps' losses are the check).

Timing: rounds interleaved in one process — a TRL `TrainerCallback` times each TRL step (`on_step_begin` ->
`on_step_end`) and then runs and times one of our steps — so both see the same machine load; the first
`--warmup` rounds are dropped; min and median printed with the ratio.

    python benchmarks/trl_dpo.py             # needs `pip install trl`; prints "skipped: trl not installed" otherwise
    python benchmarks/trl_dpo.py --quick
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from trl_interleave import interleave_callback  # noqa: E402

TOKEN_HI = 950  # random ids below the tiny tokenizer's special tokens (960+): no pad / eos inside a sequence


def make_pairs(n: int, prompt_len: tuple[int, int], response_len: tuple[int, int], seed: int = 0) -> list[dict]:
    """`n` pairs {prompt_ids, chosen_ids, rejected_ids} of random token ids and random lengths."""
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        return torch.randint(8, TOKEN_HI, (length,), generator=g).tolist()

    return [{"prompt_ids": ids(*prompt_len), "chosen_ids": ids(*response_len), "rejected_ids": ids(*response_len)}
            for _ in range(n)]


def pair_pack(pairs: list[dict]) -> dict:
    """Our pack of the pairs, as the preference loader makes it (for DPO and reward models alike): pair k's
    prompt + chosen and prompt + rejected are sequences 2k and 2k + 1 of one row, the response tokens labelled."""
    from megatron_vlm.data.packing import collate_pack
    from megatron_vlm.data.processing import ProcessedSample

    samples = []
    for p in pairs:
        for response in (p["chosen_ids"], p["rejected_ids"]):
            ids = torch.tensor(p["prompt_ids"] + response)
            mask = torch.zeros(len(ids), dtype=torch.bool)
            mask[len(p["prompt_ids"]):] = True
            samples.append(ProcessedSample(input_ids=ids, label_mask=mask))
    pack = collate_pack(samples)
    pack["pair_index"] = torch.arange(len(pairs))
    pack["num_pairs"] = torch.tensor(len(pairs))
    return pack


class _SamePack:
    """The training loader of the benchmark: the same pack every step."""

    packs_per_epoch = 1
    epoch = 0

    def __init__(self, pack: dict):
        self.pack = pack

    def __iter__(self):
        while True:
            yield dict(self.pack)

    def state_dict(self) -> dict:
        return {}

    def mark(self) -> None:
        """`SFTDataLoader.mark`: no position to remember (the same pack every step)."""

    def rewind(self) -> None:
        """`SFTDataLoader.rewind`: nothing to put back."""


class _NoMetrics:
    def log_moe_table(self, *a, **kw) -> None:
        pass


def our_context(folder: Path, out_dir: Path, mode: str, lr: float, extra: dict):
    """A RunContext of a job config for `mode` on `folder` (one process, fp32, constant lr, clip 1.0)."""
    from megatron_vlm.config import load_config_dict
    from megatron_vlm.parallel import init_distributed
    from megatron_vlm.training.context import RunContext

    data = out_dir / "pairs.jsonl"  # the config wants a train path; the benchmark feeds its own pack
    data.write_text(json.dumps({"prompt": "1 + 1?", "chosen": "2", "rejected": "3"}) + "\n")
    raw = {"model": {"path": str(folder), "dtype": "float32"},
           "data": {"type": "messages_jsonl", "train_path": str(data), "num_workers": 0},
           "train": {"mode": mode, "output_dir": str(out_dir / "run"), "seed": 0, "max_steps": 10**6,
                     "max_grad_norm": 1.0, "precision": "fp32"},
           "optimizer": {"lr": lr, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8},
           "scheduler": {"type": "constant", "warmup_steps": 0}, **extra}
    cfg = load_config_dict(raw)
    return RunContext(cfg=cfg, env=init_distributed(), run_dir=Path(cfg.train.output_dir))


def force_fsdp(on: bool) -> None:
    """`--fsdp on`: FSDP2 units even for one fp32 CPU process (a job keeps plain parameters there)."""
    if on:
        import megatron_vlm.training.model_bundle as mb

        mb.fsdp_needed = lambda *a, **kw: True


class OurPairJob:
    """One optimizer step of ours through the real pair step (`PairStep.train_step`), as a job runs it."""

    def __init__(self, step, pack: dict, prompt_sharing: str = "auto"):
        self.step_obj, self.n = step, 0
        if prompt_sharing == "off":
            step.share_prompts = False
        self.forward_tokens = int(step.prepared(pack)["input_ids"].numel())  # after prompt sharing, if on
        self.metrics: list[dict] = []  # the logged metrics of the first steps (the loss check)

    def step(self) -> float:
        log = self.n < 3
        t0 = time.perf_counter()
        out = self.step_obj.train_step(self.n, log=log)
        dt = time.perf_counter() - t0
        if log:
            self.metrics.append(out)
        self.n += 1
        return dt


def build_our_dpo(folder: Path, out_dir: Path, pairs: list[dict], *, beta: float, lr: float, fsdp: bool,
                  prompt_sharing: str = "auto") -> OurPairJob:
    from megatron_vlm.training.dpo.build import build_reference, dpo_section
    from megatron_vlm.training.dpo.step import DPOStep
    from megatron_vlm.training.model_bundle import build_model_bundle
    from megatron_vlm.training.optim import build_optim_state

    ctx = our_context(folder, out_dir, "dpo", lr, {"dpo": {"beta": beta, "loss_type": "sigmoid",
                                                           "reference": "on_the_fly"}})
    force_fsdp(fsdp)
    bundle = build_model_bundle(ctx)
    pack = pair_pack(pairs)
    loader = _SamePack(pack)
    dpo = dpo_section(ctx.cfg)
    reference = build_reference(ctx, bundle, dpo, loader, None)
    optim = build_optim_state(bundle.wrapper, ctx.cfg, "cpu", 10**6)
    step = DPOStep(ctx, bundle, optim, _NoMetrics(), loader, dpo=dpo, reference=reference)
    return OurPairJob(step, pack, prompt_sharing)


def interleave(trainer_factory: Callable[[Any], Any], ours: OurPairJob) -> dict[str, list[float]]:
    """Run the TRL trainer `trainer_factory(callback)` builds; after each TRL step, one of ours."""
    times: dict[str, list[float]] = {"trl": [], "ours": []}
    trainer_factory(interleave_callback(times, ours.step)).train()
    return times


def report(times: dict[str, list[float]], warmup: int, pairs: int) -> dict:
    rows = []
    for name, v in times.items():
        v = v[warmup:]
        rows.append({"name": name, "min_s": min(v), "median_s": statistics.median(v),
                     "pairs_per_s_median": pairs / statistics.median(v)})
    ratio_median, ratio_min = rows[0]["median_s"] / rows[1]["median_s"], rows[0]["min_s"] / rows[1]["min_s"]
    print(f"{'':6s} {'min s':>9s} {'median s':>9s} {'pairs/s (median)':>17s}")
    for r in rows:
        print(f"{r['name']:6s} {r['min_s']:9.4f} {r['median_s']:9.4f} {r['pairs_per_s_median']:17.1f}")
    print(f"TRL / ours step time: x{ratio_median:.2f} (median), x{ratio_min:.2f} (min)")
    return {"rows": rows, "ratio_median": ratio_median, "ratio_min": ratio_min}


def common_args(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="few rounds, a small batch (smoke test)")
    ap.add_argument("--rounds", type=int, default=20, help="timed rounds (one TRL step + one of ours each)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=16, help="preference pairs per optimizer step")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 128), metavar=("MIN", "MAX"))
    ap.add_argument("--response-len", type=int, nargs=2, default=(16, 96), metavar=("MIN", "MAX"))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: reproducible on a shared machine)")
    ap.add_argument("--fsdp", choices=("auto", "on"), default="auto",
                    help="our model's FSDP2 units: as a job (auto: none for one fp32 CPU process) or always (on)")
    ap.add_argument("--prompt-sharing", choices=("auto", "off"), default="auto",
                    help="ours: each pair's prompt computed once where the model allows (auto, as a job) or packed "
                         "twice, once per response (off: the layout before training/pair_prompts.py)")
    ap.add_argument("--json", type=str, default=None)
    return ap


def setup(args, prefix: str):
    """(tmp dir, model folder, tokenizer, pairs) after the common flags are applied."""
    if args.quick:
        args.rounds, args.warmup, args.pairs = 2, 1, 4
    torch.set_num_threads(args.threads)
    os.environ.setdefault("WANDB_DISABLED", "true")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from transformers import AutoTokenizer

    from megatron_vlm.testing.tiny_text_model import build_tiny_qwen_text_folder

    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    folder = build_tiny_qwen_text_folder(tmp / "tiny-qwen2", model_type="qwen2", hidden=args.hidden, layers=args.layers)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    pairs = make_pairs(args.pairs, tuple(args.prompt_len), tuple(args.response_len))
    return tmp, folder, tokenizer, pairs


def meta(args, pairs: list[dict], ours: OurPairJob, extra: dict) -> dict:
    import transformers
    import trl

    tokens = sum(2 * len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in pairs)
    return {"device": f"cpu ({args.threads} thread(s))", "torch": torch.__version__,
            "transformers": transformers.__version__, "trl": trl.__version__, "pairs": args.pairs, "tokens": tokens,
            "hidden": args.hidden, "layers": args.layers, "fsdp": args.fsdp, "rounds": args.rounds,
            "prompt_sharing": args.prompt_sharing, "our_forward_tokens": ours.forward_tokens,
            "load_avg": round(os.getloadavg()[0], 1), "date": time.strftime("%Y-%m-%d"), **extra}


def main() -> int:
    ap = common_args(__doc__.split("\n")[0])
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=1e-6)
    args = ap.parse_args()
    if importlib.util.find_spec("trl") is None:
        print("skipped: trl not installed (pip install trl)")
        return 0
    tmp, folder, tokenizer, pairs = setup(args, "trl_dpo_bench_")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    ours = build_our_dpo(folder, tmp, pairs, beta=args.beta, lr=args.lr, fsdp=args.fsdp == "on",
                         prompt_sharing=args.prompt_sharing)
    steps = args.warmup + args.rounds
    trl_first: list[dict] = []

    class PreTokenisedDPO(DPOTrainer):
        """TRL's trainer on rows that are already token ids (its tokenisation skipped, nothing else changed); the
        first steps' loss and log-prob metrics recorded for the check."""

        def _prepare_dataset(self, dataset, *a, **kw):
            return dataset

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if len(trl_first) < 3 and model.training:
                m = self._metrics["train"]
                trl_first.append({"loss": float((out[0] if return_outputs else out).detach()),
                                  "logps/chosen": m["logps/chosen"][-1], "logps/rejected": m["logps/rejected"][-1]})
            return out

    config = DPOConfig(
        output_dir=str(tmp / "trl_out"), per_device_train_batch_size=args.pairs, gradient_accumulation_steps=1,
        max_steps=steps, learning_rate=args.lr, max_grad_norm=1.0, beta=args.beta, loss_type=["sigmoid"],
        logging_steps=10**6, save_strategy="no", report_to=[], use_cpu=True, bf16=False, fp16=False,
        dataloader_num_workers=0, seed=0, disable_tqdm=True, max_length=None, lr_scheduler_type="constant",
        train_sampling_strategy="sequential",
    )
    dataset = Dataset.from_list(pairs * steps)  # in order: every step's batch is the same pairs as ours

    def factory(callback):
        return PreTokenisedDPO(model=hf_model, args=config, train_dataset=dataset, processing_class=tokenizer,
                               callbacks=[callback])

    times = interleave(factory, ours)
    print("first steps (TRL | ours):")
    for k, (t, o) in enumerate(zip(trl_first, ours.metrics)):
        print(f"  step {k + 1}: loss {t['loss']:.7f} | {o['loss']:.7f}   logps/chosen {t['logps/chosen']:.5f} | "
              f"{o['logps/chosen']:.5f}   logps/rejected {t['logps/rejected']:.5f} | {o['logps/rejected']:.5f}")
    return finish(args, pairs, ours, times, trl_first, {"beta": args.beta, "lr": args.lr})


def finish(args, pairs: list[dict], ours: OurPairJob, times: dict[str, list[float]], trl_first: list[dict],
           extra: dict) -> int:
    """The step-time table, the run's facts and (--json) both written out with the first steps of each side."""
    result = report(times, args.warmup, args.pairs)
    info = meta(args, pairs, ours, extra)
    print(json.dumps(info))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": info, **result, "first_steps": {"trl": trl_first,
                                                                                          "ours": ours.metrics}},
                                              indent=2, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
