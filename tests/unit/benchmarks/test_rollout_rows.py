"""The non-timing parts of `bench_rollout.py --engines ours,vllm` (benchmarks/e2e/rollout_rows.py,
rollout_engines_row.py): `--row` / `--engines` parsing, the row shapes the rollout-speed issue names, and the
FLOP counts behind the achieved-GEMM-rate figure, checked against torch's own FLOP counter run over
transformers' models (a decode step with a KV cache), not against the formula's own arithmetic."""
import dataclasses
import importlib
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

BENCH_DIR = Path(__file__).resolve().parents[3] / "benchmarks" / "e2e"


def _load(name):
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    return importlib.import_module(name)  # the scripts import each other by name from their folder


rows = _load("rollout_rows")


def test_row_selection_by_letter_name_and_all():
    assert [r.letter for r in rows.resolve_rows("a,c")] == ["a", "c"]
    assert [r.letter for r in rows.resolve_rows("qwen2_110m, e,b")] == ["b", "e"]  # duplicates once, in order
    assert [r.letter for r in rows.resolve_rows("all")] == ["a", "b", "c", "d", "e"]
    for bad in ("f", "a,nope", "", ","):
        with pytest.raises(ValueError, match="--row: unknown.*known: all, a \\(tiny_qwen2\\)"):
            rows.resolve_rows(bad)


def test_engine_selection():
    eng = _load("rollout_engines_row")
    assert eng.parse_engines("ours,vllm") == ["ours", "vllm"]
    assert eng.parse_engines("vllm, ours,vllm") == ["vllm", "ours"]
    for bad in ("sglang", "ours,hf", ""):
        with pytest.raises(ValueError, match="--engines: unknown"):
            eng.parse_engines(bad)


def _hf_model(cfg):
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.random.fork_rng():
        torch.manual_seed(0)
        # eager attention and experts: matmuls the counter sees (sdpa and grouped_mm are not counted)
        return AutoModelForCausalLM.from_config(conf, attn_implementation="eager", experts_implementation="eager").eval()


def test_row_shapes_are_the_issues():
    r = rows.ROWS
    shape = {k: (v.prompts, v.prompt_tokens, v.group, v.new_tokens) for k, v in r.items()}
    assert shape == {"a": (8, 66, 8, 64), "b": (4, 512, 8, 128), "c": (8, 0, 8, 64), "d": (8, 66, 8, 64),
                     "e": (4, 512, 8, 512)}
    assert r["c"].image_tokens == 64 and r["c"].model_type == "qwen2_5_vl"
    a = rows.text_hf_config(r["a"])
    assert (a["hidden_size"], a["num_hidden_layers"], a["vocab_size"], a["model_type"]) == (256, 4, 8192, "qwen2")
    d = rows.text_hf_config(r["d"])
    assert d["model_type"] == "qwen3_moe" and d["num_local_experts"] > d["num_experts_per_tok"] > 1
    assert r["b"].gemm_rate and r["e"].gemm_rate and not r["a"].gemm_rate
    assert rows.text_hf_config(r["e"]) == rows.text_hf_config(r["b"])  # the long-decode row is b's model
    # "~110M": the parameters of transformers' model built from the row's config (meta device: no memory)
    from transformers import AutoConfig, AutoModelForCausalLM

    b = rows.text_hf_config(r["b"])
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{k: v for k, v in b.items() if k != "architectures"}))
    n = sum(p.numel() for p in m.parameters())
    assert 100e6 < n < 120e6, n
    assert (b["hidden_size"], b["num_hidden_layers"], b["vocab_size"]) == (768, 8, 32768)


SMALL = dict(hidden=64, layers=2, vocab=128, heads=4, kv_heads=2, intermediate=96)


@pytest.mark.parametrize("letter", ["a", "d"])
def test_flops_of_decode_steps_match_torch_flop_counter(letter):
    """Prefill 5 tokens into transformers' KV cache, then decode 3 single-token steps of a batch of 2 under
    FlopCounterMode: its count (every mm / bmm / sdpa) equals the row's weight-GEMM + attention formula."""
    spec = dataclasses.replace(rows.ROWS[letter], **SMALL, prompts=1, group=2, prompt_tokens=5, new_tokens=4,
                               moe_intermediate=32, experts=4)
    cfg = rows.text_hf_config(spec)
    model = _hf_model(cfg)
    ids = torch.randint(0, spec.vocab, (spec.prompts * spec.group, spec.prompt_tokens))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        with FlopCounterMode(display=False) as fc:
            for _ in range(spec.new_tokens - 1):
                out = model(tok, cache=cache, use_cache=True)
                cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    lin, attn = rows.decode_flops(spec, cfg, spec.prompt_tokens)
    assert fc.get_total_flops() == lin + attn
    with FlopCounterMode(display=False) as one:  # one token alone, at context 1: weight GEMMs + one-position attention
        model(ids[:1, :1])
    assert one.get_total_flops() == rows.linear_flops_per_token(cfg) + rows.attention_flops_per_token(cfg, 1)
