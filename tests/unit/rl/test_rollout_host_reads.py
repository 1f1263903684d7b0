"""Host reads of device values in the built-in rollout engine's per-step path (prefill, decode, sampling, stop check).

On CUDA each read of a device tensor's value, and each upload of a host list through `torch.tensor(..., device=...)`,
is a stream sync (tests/unit/training/test_step_host_reads.py says how they are counted on the CPU). A decode step
needs one read: EOS and stop strings are decided on the host from the sampled tokens, and the same read says
whether a log-prob is not finite and which rows' suppressed ids hold most of the mass (their exact log-probs are
then made from those rows' logits). Before, a step also uploaded the slot indices three times and read those rows
with a `nonzero`; admitting a prompt read its length and its keys by a bool mask per layer, each prefill's
attention whether a row sees no key, and the results came back three reads per sample. The sampler's row check on
the CPU (inference/sampling.py: CPU tensors only, never on an accelerator) is left out of the count, and the
sampling settings keep to the draws an accelerator runs (the CPU's fused C++ draw of untruncated sampling is not).

The log-probs, with rows where the vision ids hold most of the mass, are those of a full forward without cache
over prompt + completion, with those ids removed from the softmax in plain torch.
"""
from __future__ import annotations

import pytest
import torch

from megatron_vlm.inference.engine import SamplingParams
from megatron_vlm.testing.host_reads import HostReads
from tests.fixtures import tiny_qwen2_5_vl as F
from tests.fixtures.rollout_engine import SilentTokenizer, make_engine, tiny_vl_model_and_prompts

VISION = [F.IMAGE_TOKEN_ID, F.VIDEO_TOKEN_ID, F.VISION_START_TOKEN_ID, F.VISION_END_TOKEN_ID]
CPU_ONLY = "sample_tokens"  # the sampler's row check, CPU tensors only (module docstring)


@pytest.fixture(scope="module")
def model_and_prompts():
    return tiny_vl_model_and_prompts(3)


def _reads(model, prompts, budget: int, sampling: dict, **options):
    host = [t for p in prompts for t in (p.input_ids, p.pixel_values, p.image_grid_thw) if t is not None]
    eng = make_engine(model, SilentTokenizer(), eos_token_ids=[-1], **options)
    params = SamplingParams(max_new_tokens=budget, n=2, **sampling)
    with HostReads(host=host) as reads:
        eng.generate(prompts, params, generator=torch.Generator().manual_seed(0))
    return sum(n for (_, site), n in reads.sites.items() if CPU_ONLY not in site), reads


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "top_k": 5, "top_p": 0.9},
                                      {"temperature": 1.0, "top_p": 0.95, "stop": ("x",)}], ids=["greedy", "top-k-p", "stop"])
@pytest.mark.parametrize("options", [{}, {"kv_block_size": 4}], ids=["slots", "paged"])
def test_a_decode_step_reads_the_device_once(model_and_prompts, sampling, options):
    """One read per sampled token position (the first from the prefill's logits), one for the results."""
    model, prompts = model_and_prompts
    budget = 6
    total, reads = _reads(model, prompts, budget, sampling, **options)
    assert total == budget + 1, f"{total} host reads for {budget} sampling steps:\n{reads.report()}"


def _biased(model, lift: float):
    """The model's logits with the vision ids raised by `lift` where the row's logit of id 0 exceeds that of id 1:
    there the suppressed ids hold most of the mass (the sampler's exact rows), elsewhere not."""
    vision = torch.tensor(VISION)

    def forward(**kwargs):
        logits = model(**kwargs)
        up = lift * (logits[..., :1] > logits[..., 1:2]).to(logits.dtype)
        return logits.index_add(-1, vision, up.expand(*logits.shape[:-1], len(VISION)))
    return forward


@pytest.mark.parametrize("lift", [9.0, 60.0])  # 60: the other ids' probabilities underflow float32
def test_rows_held_by_suppressed_ids_get_exact_logprobs(model_and_prompts, lift):
    model, prompts = model_and_prompts
    forward = _biased(model, lift)
    temperature = 0.7  # top_p: the draw an accelerator runs (not the CPU's fused one)
    eng = make_engine(model, SilentTokenizer(), eos_token_ids=[-1], forward=forward)
    res = eng.generate(prompts, SamplingParams(max_new_tokens=6, n=2, temperature=temperature, top_p=0.98),
                       generator=torch.Generator().manual_seed(1))
    heavy = light = 0
    with torch.no_grad():
        for s in res.samples:
            p = prompts[s.prompt_index]
            ids = torch.cat([p.input_ids, s.token_ids[:-1]])
            logits = forward(input_ids=ids[None], pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw)[0]
            rows = logits[len(p.input_ids) - 1:].float() / temperature
            mass = torch.softmax(rows, -1)[:, VISION].sum(-1)
            heavy, light = heavy + int((mass > 0.5).sum()), light + int((mass <= 0.5).sum())
            want = torch.log_softmax(rows.index_fill(-1, torch.tensor(VISION), float("-inf")), -1)
            want = want.gather(-1, s.token_ids[:, None]).squeeze(-1)
            torch.testing.assert_close(s.logprobs, want, rtol=1e-4, atol=1e-4)
    assert heavy and light  # both kinds of rows were drawn
