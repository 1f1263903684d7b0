"""The recorded routes of a sample must cover exactly the tokens the rollout read: prompt + response - 1.

A record of another length belongs to another token layout (a prompt re-encoded to another length on the
trainer side, a response cut after the rollout, a sample paired with another's routes): replaying it would send
every token after the first difference to the experts of another token. `pack_samples` refuses it, naming the
shapes, instead of cutting the record to fit.
"""
from __future__ import annotations

import pytest
import torch

from megatron_vlm.inference.engine import RolloutPrompt
from megatron_vlm.rl.batching import TrainSample, pack_samples

LAYERS, K = 2, 2


def _sample(prompt_len: int, response_len: int, route_rows: int) -> TrainSample:
    g = torch.Generator().manual_seed(prompt_len * 100 + response_len)
    prompt = RolloutPrompt(torch.randint(0, 50, (prompt_len,), generator=g))
    routes = torch.randint(0, 8, (route_rows, LAYERS, K), generator=g).to(torch.int8)
    return TrainSample(prompt, torch.randint(0, 50, (response_len,), generator=g), torch.zeros(response_len), 0.0,
                       routes=routes)


@pytest.mark.parametrize("share", [False, True])
def test_exact_records_are_packed_in_token_order(share):
    a, b = _sample(5, 3, 7), _sample(4, 2, 5)
    b2 = TrainSample(a.prompt, torch.tensor([9, 8]), torch.zeros(2), 0.0, routes=torch.cat([a.routes[:5], b.routes[:1]]))
    samples = [a, b2, b] if share else [a, b]
    batch = pack_samples(samples, share_prompts=share)
    assert batch["routes"].shape[0] == batch["input_ids"].shape[1]
    if not share:  # each sample's record, in order (the final token of each completion is left out of the pack)
        assert torch.equal(batch["routes"], torch.cat([a.routes, b.routes]))


@pytest.mark.parametrize("rows", [6, 8, 12])  # short by one, long by one, long by five (exact: 7)
def test_a_record_of_another_length_is_refused(rows):
    bad = _sample(5, 3, rows)
    with pytest.raises(ValueError, match=rf"routes of shape \({rows}, 2, 2\) for 7 read tokens"):
        pack_samples([bad])
    with pytest.raises(ValueError, match="read tokens"):
        pack_samples([_sample(4, 2, 5), bad], share_prompts=True)
