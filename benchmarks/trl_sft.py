"""SFT step throughput: ours vs TRL's `SFTTrainer` on the same tiny Qwen2 model, weights and data.

Why: TRL is what most users would otherwise run for SFT; the figure to beat is samples/s of one
optimizer step (forward, backward, clip, AdamW) at equal data. Setup: a tiny Qwen2 folder
(`testing.tiny_text_model`, random weights), loaded by transformers (`Qwen2ForCausalLM`, SDPA
attention) for TRL and by our loader for us; `--samples` prompt + completion samples of random
lengths, loss on the completion tokens only (TRL: `completion_only_loss` on a pre-tokenised dataset;
ours: pre-shifted labels). Each framework runs its own default path for a job: TRL pads the batch
(its default collator), we pack the samples into one row with `cu_seqlens` and run the model under
FSDP2 on a one-rank mesh as `launch/pretrain_vlm.py` does (`--no-fsdp`: plain module, to measure
the wrapper's cost). Both use fp32, gradient clipping at 1.0, their default AdamW.

Timing: the rounds are interleaved in one process — a TRL `TrainerCallback` times each TRL step
(`on_step_begin` -> `on_step_end`) and then runs and times one of our steps — so both see the same
machine load; the first `--warmup` rounds are dropped; min and median are printed with the ratio.

    python benchmarks/trl_sft.py                       # needs `pip install trl`; prints "skipped: trl not installed" otherwise
    python benchmarks/trl_sft.py --quick               # a few steps
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
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from trl_interleave import interleave_callback  # noqa: E402


def make_samples(n: int, vocab: int, min_len: int, max_len: int, seed: int = 0) -> list[dict]:
    """Random token samples: the first half is the prompt, the second half the completion."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(8, vocab - 8, (length,), generator=g).tolist()
        prompt = length // 2
        out.append({"input_ids": ids, "completion_mask": [0] * prompt + [1] * (length - prompt)})
    return out


def packed_batch(samples: list[dict]) -> dict:
    """Our micro-batch: every sample back to back in one row, labels shifted inside each sample."""
    from megatron_vlm.data.batch import shifted_labels

    ids = torch.tensor([t for s in samples for t in s["input_ids"]])
    mask = torch.tensor([m == 1 for s in samples for m in s["completion_mask"]])
    lengths = [len(s["input_ids"]) for s in samples]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return {"input_ids": ids[None], "labels": shifted_labels(ids, mask, cu)[None], "cu_seqlens": cu}


class OurSFT:
    """One SFT optimizer step of ours, as the SFT loop runs it (TokenLogprobModel, clip, fused AdamW)."""

    def __init__(self, folder: Path, samples: list[dict], fsdp: bool):
        from megatron_vlm.checkpoint.hf import load_hf_model
        from megatron_vlm.models import get_family
        from megatron_vlm.parallel import build_mesh, clip_grad_norm_, init_distributed
        from megatron_vlm.training.lm_loss import TokenLogprobModel
        from megatron_vlm.training.optim import build_optimizer

        env = init_distributed()
        self.model = load_hf_model(str(folder), dtype=torch.float32, device="cpu")
        self.wrapper = TokenLogprobModel(self.model)
        if fsdp:
            parallel = SimpleNamespace(dp_replicate=1, dp_shard=-1, compile=False, reshard_after_forward=True)
            dims, mesh = build_mesh(parallel, env.world_size, "cpu")
            get_family(self.model.hf_config.get("model_type")).parallelize(self.model, dims, parallel, mesh=mesh, root=self.wrapper)
        self.optimizer = build_optimizer(self.wrapper, SimpleNamespace(lr=1e-5, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8), "cpu")
        self.params = [p for p in self.wrapper.parameters() if p.requires_grad]
        self.batch = packed_batch(samples)
        self.n_trained = int((self.batch["labels"] != -100).sum())
        self.clip = clip_grad_norm_

    def step(self) -> float:
        t0 = time.perf_counter()
        logp = self.wrapper(self.batch)
        loss = -logp.sum(dtype=torch.float32) / self.n_trained
        loss.backward()
        self.clip(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


def summarise(name: str, times: list[float], samples: int) -> dict:
    return {"name": name, "min_s": min(times), "median_s": statistics.median(times),
            "samples_per_s_median": samples / statistics.median(times), "samples_per_s_max": samples / min(times)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="few rounds (smoke test)")
    ap.add_argument("--rounds", type=int, default=20, help="timed rounds (one TRL step + one of ours each)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--samples", type=int, default=32, help="samples per optimizer step")
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=160)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: reproducible on a shared machine)")
    ap.add_argument("--no-fsdp", action="store_true", help="run ours without the FSDP2 wrapper (its overhead)")
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    if importlib.util.find_spec("trl") is None:
        print("skipped: trl not installed (pip install trl)")
        return 0
    if args.quick:
        args.rounds, args.warmup = 3, 1
    torch.set_num_threads(args.threads)
    os.environ.setdefault("WANDB_DISABLED", "true")
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from megatron_vlm.testing.tiny_text_model import build_tiny_qwen_text_folder

    tmp = Path(tempfile.mkdtemp(prefix="trl_sft_bench_"))
    folder = build_tiny_qwen_text_folder(tmp / "tiny-qwen2", model_type="qwen2", hidden=args.hidden, layers=args.layers)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    samples = make_samples(args.samples, hf_model.config.vocab_size, args.min_len, args.max_len)
    ours = OurSFT(folder, samples, fsdp=not args.no_fsdp)

    steps = args.warmup + args.rounds
    times = {"trl": [], "ours": []}

    interleave = interleave_callback(times, ours.step)

    config = SFTConfig(
        output_dir=str(tmp / "trl_out"), per_device_train_batch_size=args.samples, gradient_accumulation_steps=1,
        max_steps=steps, learning_rate=1e-5, max_grad_norm=1.0, logging_steps=10**6, save_strategy="no",
        report_to=[], use_cpu=True, bf16=False, fp16=False, dataloader_num_workers=0, completion_only_loss=True,
        max_length=None, seed=0, disable_tqdm=True,
    )
    dataset = Dataset.from_list(samples * steps)  # one epoch covers every step; identical batches each step
    trainer = SFTTrainer(model=hf_model, args=config, train_dataset=dataset, processing_class=tokenizer,
                         callbacks=[interleave])
    trainer.train()
    rows = [summarise(k, v[args.warmup:], args.samples) for k, v in times.items()]
    ratio_median = rows[0]["median_s"] / rows[1]["median_s"]
    ratio_min = rows[0]["min_s"] / rows[1]["min_s"]
    print(f"{'':6s} {'min s':>9s} {'median s':>9s} {'samples/s (median)':>19s}")
    for r in rows:
        print(f"{r['name']:6s} {r['min_s']:9.4f} {r['median_s']:9.4f} {r['samples_per_s_median']:19.1f}")
    print(f"ours / TRL samples/s: x{ratio_median:.2f} (median), x{ratio_min:.2f} (min)  [target >= 1.2]")
    meta = {"device": f"cpu ({args.threads} thread(s))", "torch": torch.__version__, "transformers": transformers.__version__,
            "trl": trl.__version__, "samples": args.samples, "tokens": sum(len(s["input_ids"]) for s in samples),
            "hidden": args.hidden, "layers": args.layers, "fsdp": not args.no_fsdp, "rounds": args.rounds,
            "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows, "ratio_median": ratio_median,
                                               "ratio_min": ratio_min}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
