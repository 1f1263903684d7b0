"""REINFORCE++'s returns read the step's KL total once, not once per sample.

On CUDA each read of a device tensor's value is a stream sync; a step of 512 completions read its KL total 512 times.
Counted on the CPU with `HostReads`, the samples' log-probs standing for device tensors (no `host` given), so that a
read per sample would show. The outputs are those written out here: each sample's rewards-to-go of
r_t = -beta (log pi_old - log pi_ref) + [t = last] score, and the KL total as the sum of each sample's float32 sum.
"""
from __future__ import annotations

import pytest
import torch

from megatron_vlm.rl.batch_advantages import BatchAdvantages
from megatron_vlm.testing.host_reads import HostReads
from tests.fixtures.rl_config import rl_config
from tests.unit.rl.test_reinforce_plus_plus import ONE, RPP, _batch, _samples


@pytest.mark.parametrize("n", [1, 12])
def test_the_kl_total_is_one_read_per_step(n):
    rewards, olds, refs = _batch(11, n)
    samples = _samples(rewards, olds, refs, estimator=RPP, group_size=1)
    ba = BatchAdvantages(rl_config(validate=True, advantage=RPP, group_size=1, loss__kl_coef=0.3,
                                   loss__kl_estimator="k1", advantages__gamma=0.8), ONE)
    with HostReads() as reads:
        gs, kl = ba.returns(samples)
    assert reads.total == 1, reads.report()
    assert kl == sum(float((o.float() - r.float()).sum()) for o, r in zip(olds, refs))  # bit for bit
    for g, o, r, s in zip(gs, olds, refs, samples):
        rt = [-0.3 * float(x) for x in (o.float() - r.float())]
        rt[-1] += s.advantage
        want = [sum(0.8 ** (j - t) * rt[j] for j in range(t, len(rt))) for t in range(len(rt))]
        torch.testing.assert_close(g, torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-6)


def test_no_kl_no_read():
    rewards, olds, refs = _batch(12, 6)
    samples = _samples(rewards, olds, refs, estimator="reinforce_plus_plus_baseline", group_size=3)
    ba = BatchAdvantages(rl_config(validate=True, advantage="reinforce_plus_plus_baseline", group_size=3), ONE)
    with HostReads() as reads:
        _, kl = ba.returns(samples)
    assert reads.total == 0 and kl == 0.0, reads.report()
