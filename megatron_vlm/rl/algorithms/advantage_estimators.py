"""Advantage estimators by name (`[rl] advantage`), and the frozen spec of a run's advantages.

Three kinds. A group estimator maps a group-major reward matrix [P, G] (G completions per prompt) to
advantages of the same shape; the equations are in the module docstring of `megatron_vlm.rl.advantages`,
which also holds what every estimator shares (equal-reward groups, dropping, statistics). A token estimator
(`gae`, PPO with a critic) maps per-token rewards and the critic's per-token values to per-token advantages
and returns; it runs in the update, after the critic's forward (megatron_vlm/rl/critic/). A batch estimator
(`reinforce_plus_plus`, `reinforce_plus_plus_baseline`: REINFORCE++, Hu et al. 2025) is a group function that
gives each completion's outcome score (its reward, or its reward minus its group's mean) followed, in the update
once the reference log-probs are known, by per-token rewards-to-go (`reinforce_returns`) whitened over every
response token of the step on all data-parallel ranks (megatron_vlm/rl/batch_advantages.py).

Groups: a group estimator's baseline is the prompt's other completions, so it needs `rl.batch.group_size` >= 2 (a
group of one has advantage 0 always); a token estimator's baseline is the critic's values, and
`reinforce_plus_plus`'s the mean over the whole batch, so one completion per prompt is enough (verl runs PPO and
REINFORCE++ with `rollout.n = 1`). `AdvantageEstimator.needs_groups` says which; the config
refuses `group_size = 1` for the others, naming the key and the estimator.

Adding an estimator: a function with the `AdvantageFn` signature decorated with
`@register_advantage("name", std_normalisable=...)` (`std_normalisable`: it divides by the group std unless
`normalize_adv_std = false`; otherwise asking it to is refused; `needs_groups=False` for one whose baseline is not
the group's, e.g. a batch-wide one: it then also runs with groups of one, the [P, 1] matrix; `batch_normalised=True`
for a batch estimator, `kl_in_reward=True` when `loss.kl_coef`'s penalty goes into its per-token rewards instead of
the loss by default); a token estimator with the `TokenAdvantageFn` signature decorated with
`@register_token_advantage("name")`.

Where the KL penalty goes (`kl_in_reward`): a batch estimator has per-token rewards, so `rl.advantages.kl_in_reward`
may move `loss.kl_coef`'s penalty into them or keep it in the loss (its registered default when unset); a token
estimator (`gae`) always has it in the critic's rewards; a group estimator has one advantage per completion and keeps
it in the loss. One coefficient goes to one place: never in both.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from megatron_vlm.rl.algorithms.registry import Registry

__all__ = ["ADVANTAGE_ESTIMATORS", "AdvantageEstimator", "AdvantageFn", "AdvantageSpec", "TokenAdvantageFn",
           "register_advantage", "register_token_advantage", "resolve_normalize_std", "needs_critic",
           "min_group_size", "gae_advantages", "GAE_DEFAULT_GAMMA", "GAE_DEFAULT_LAM", "batch_normalised", "kl_in_reward",
           "kl_in_reward_choices", "reads_gamma", "reinforce_returns"]


class AdvantageFn(Protocol):
    """`(r [P, G], *, normalize_std, eps) -> advantages [P, G]`."""

    def __call__(self, r: torch.Tensor, *, normalize_std: bool, eps: float) -> torch.Tensor: ...


class TokenAdvantageFn(Protocol):
    """`(token_rewards, values, mask, *, gamma, lam, seq_ids) -> (advantages, returns)`, all of one shape: padded
    [B, T] (rows are the sequences) or packed [N] with `seq_ids` (the sequence of every position)."""

    def __call__(self, token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float,
                 lam: float, seq_ids: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    fn: Optional[AdvantageFn]
    """The group estimator (None for a token estimator)."""
    std_normalisable: bool
    """Divides by the group std by default (false: defined without the division; asking for it is an error).
    A token estimator: whitens its advantages over the step's tokens by default."""
    token_fn: Optional[TokenAdvantageFn] = None
    """The token estimator (needs a critic: `[rl.critic]`); None for a group estimator."""
    needs_groups: bool = True
    """Its baseline is the other completions of the prompt: `rl.batch.group_size` >= 2. False: one completion per
    prompt works (a token estimator, whose baseline is the critic's values; `reinforce_plus_plus`, whose baseline is
    the batch mean)."""
    batch_normalised: bool = False
    """A batch estimator: `fn` gives each completion's outcome score; the update turns it into per-token
    rewards-to-go (`reinforce_returns`) and whitens them over the step's response tokens on all data-parallel ranks
    (megatron_vlm/rl/batch_advantages.py; `normalize_adv_std = false`: centred only)."""
    kl_in_reward: bool = False
    """By default (`rl.advantages.kl_in_reward` unset) `loss.kl_coef`'s KL penalty is folded into the per-token
    rewards (-kl_coef x KL_t on every response token) instead of the loss (`reinforce_plus_plus`; `gae` always)."""


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", "advantage")


def register_advantage(name: str, *, std_normalisable: bool, needs_groups: bool = True, batch_normalised: bool = False,
                       kl_in_reward: bool = False) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: register `fn` as the estimator `name` (the function is returned unchanged); `needs_groups`,
    `batch_normalised`, `kl_in_reward`: those fields of `AdvantageEstimator`."""
    if kl_in_reward and not batch_normalised:
        raise ValueError(f"{name}: kl_in_reward needs per-token rewards, which only a batch estimator has")

    def add(fn: AdvantageFn) -> AdvantageFn:
        ADVANTAGE_ESTIMATORS.register(name)(AdvantageEstimator(name, fn, std_normalisable, needs_groups=needs_groups,
                                                               batch_normalised=batch_normalised,
                                                               kl_in_reward=kl_in_reward))
        return fn
    return add


@register_advantage("grpo", std_normalisable=True)
def grpo_advantages(r: torch.Tensor, *, normalize_std: bool, eps: float) -> torch.Tensor:
    """(r_i - mean) / (std + eps), the unbiased group std (DeepSeekMath); r_i - mean without the std."""
    centred = r - r.mean(dim=1)[:, None]
    return centred / (r.std(dim=1)[:, None] + eps) if normalize_std else centred


@register_advantage("dr_grpo", std_normalisable=False)
def dr_grpo_advantages(r: torch.Tensor, *, normalize_std: bool, eps: float) -> torch.Tensor:
    """r_i - mean (Dr. GRPO: no std division)."""
    return r - r.mean(dim=1)[:, None]


@register_advantage("rloo", std_normalisable=False)
def rloo_advantages(r: torch.Tensor, *, normalize_std: bool, eps: float) -> torch.Tensor:
    """r_i - mean of the other G - 1 rewards = G / (G - 1) * (r_i - mean) (REINFORCE leave-one-out)."""
    return r - (r.sum(dim=1, keepdim=True) - r) / (r.shape[1] - 1)


@register_advantage("reinforce_plus_plus", std_normalisable=True, needs_groups=False, batch_normalised=True,
                    kl_in_reward=True)
def reinforce_pp_scores(r: torch.Tensor, *, normalize_std: bool, eps: float) -> torch.Tensor:
    """REINFORCE++ (Hu et al. 2025): each completion's own reward, no group baseline. In the update the reward goes on
    its last token, -kl_coef x KL_t on every token (KL_t of the sampling policy against the reference, loss.kl_estimator;
    the paper's is k1), and the advantage of token t is the return G_t = sum_{s >= t} gamma^(s - t) r_s
    (advantages.gamma, unset = 1), whitened over every response token of the step on all ranks: (G - mean) /
    sqrt(var + 1e-8), the unbiased variance (as verl's `compute_reinforce_plus_plus_outcome_advantage`; OpenRLHF's
    `reinforce`). The batch mean is the baseline: one completion per prompt works."""
    return r.clone()


@register_advantage("reinforce_plus_plus_baseline", std_normalisable=True, batch_normalised=True)
def reinforce_pp_baseline_scores(r: torch.Tensor, *, normalize_std: bool, eps: float) -> torch.Tensor:
    """REINFORCE++ with baseline (Hu et al. 2025, for reasoning with G > 1 samples per prompt): r_i minus the mean
    reward of its group, the same value on every token of the completion, whitened over every response token of the
    step on all ranks as `reinforce_plus_plus`. By default the KL penalty stays in the loss (loss.kl_coef,
    loss.kl_estimator), as in the paper (a KL loss term) and verl's default `use_kl_in_reward = false`. With
    `advantages.kl_in_reward = true` it goes into the per-token rewards instead: -kl_coef x KL_t on every token, the
    centred score added at the last, and each token's advantage is its return (OpenRLHF's `reinforce_baseline`
    without `--use_kl_loss`; verl instead sums the KL into the score before the group mean, one value per
    completion). No discount either way (advantages.gamma is refused)."""
    return r - r.mean(dim=1, keepdim=True)


def batch_normalised(estimator: str) -> bool:
    """Whether `estimator` is a batch estimator (REINFORCE++: per-token advantages whitened over the step)."""
    return estimator in ADVANTAGE_ESTIMATORS and ADVANTAGE_ESTIMATORS.get(estimator).batch_normalised


def kl_in_reward(estimator: str, setting: Optional[bool] = None) -> bool:
    """Whether `loss.kl_coef`'s KL penalty goes into `estimator`'s per-token rewards instead of the loss:
    `setting` (`rl.advantages.kl_in_reward`) where given, else the estimator's default (gae, reinforce_plus_plus).
    Which settings an estimator takes: `kl_in_reward_choices`."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        return False
    if setting is not None:
        return bool(setting)
    est = ADVANTAGE_ESTIMATORS.get(estimator)
    return est.kl_in_reward or est.token_fn is not None


def kl_in_reward_choices(estimator: str) -> tuple[bool, ...]:
    """The values of `rl.advantages.kl_in_reward` that `estimator` can honour: both for a batch estimator (per-token
    rewards, and a loss that can hold the KL term), true only for a token estimator (the critic learns the rewards
    with the penalty in them), false only for a group estimator (one advantage per completion: no per-token reward)."""
    est = ADVANTAGE_ESTIMATORS.get(estimator)
    if est.token_fn is not None:
        return (True,)
    return (False, True) if est.batch_normalised else (False,)


def reads_gamma(estimator: str) -> bool:
    """Whether `estimator` discounts per-token rewards by `advantages.gamma` (gae, reinforce_plus_plus; not the
    baseline variant, whose returns are undiscounted with the KL in its rewards too)."""
    return kl_in_reward(estimator)


def reinforce_returns(token_rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float,
                      seq_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each response token's discounted reward-to-go G_t = sum_{s >= t, s in mask} gamma^(k(s) - k(t)) r_s, k counting
    the sequence's masked positions (positions outside `mask` are skipped, neither adding a reward nor a discount
    step, as `gae_advantages`); 0 outside `mask`. Padded [B, T] or packed [N] with `seq_ids`; detached; float64
    for float64 input, else float32."""
    if token_rewards.shape != mask.shape:
        raise ValueError(f"token_rewards {tuple(token_rewards.shape)} and mask {tuple(mask.shape)} must have one shape")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma: must be in [0, 1], got {gamma}")
    dtype = torch.float64 if token_rewards.dtype == torch.float64 else torch.float32
    (r, m), unpad = _rows([token_rewards.detach().to(dtype), mask.to(dtype)], seq_ids)
    ret = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])  # [rows]: r[:, 0] would not exist for rows of no position
    for t in reversed(range(r.shape[1])):
        mt = m[:, t]
        running = (r[:, t] + gamma * running) * mt + running * (1 - mt)
        ret[:, t] = running
    return unpad(ret * m)


GAE_DEFAULT_GAMMA = 1.0
"""`advantages.gamma` unset: no discount over the response tokens (the reward sits on the last token; TRL and
verl's PPO default, and REINFORCE++'s)."""
GAE_DEFAULT_LAM = 0.95
"""`advantages.lam` unset: TRL's PPO default."""


def register_token_advantage(name: str) -> Callable[[TokenAdvantageFn], TokenAdvantageFn]:
    """Decorator: register `fn` as the token estimator `name` (needs the critic; returned unchanged)."""
    def add(fn: TokenAdvantageFn) -> TokenAdvantageFn:
        ADVANTAGE_ESTIMATORS.register(name)(AdvantageEstimator(name, None, True, token_fn=fn, needs_groups=False))
        return fn
    return add


def needs_critic(estimator: str) -> bool:
    """Whether `estimator` is a token estimator (values from a critic); False for unknown names too."""
    return estimator in ADVANTAGE_ESTIMATORS and ADVANTAGE_ESTIMATORS.get(estimator).token_fn is not None


def min_group_size(estimator: str) -> int:
    """The smallest `rl.batch.group_size` `estimator` gives a learning signal with: 2 for a group-relative one, 1
    otherwise (ValueError naming the key for an unknown name)."""
    return 2 if ADVANTAGE_ESTIMATORS.get(estimator).needs_groups else 1


def _rows(tensors: list[torch.Tensor], seq_ids: Optional[torch.Tensor]) -> tuple[list[torch.Tensor],
                                                                             Callable[[torch.Tensor], torch.Tensor]]:
    """`tensors` (one layout: padded [B, T], or packed [N] with `seq_ids`) as [rows, positions], and the function that
    takes a [rows, positions] result back to that layout."""
    first = tensors[0]
    if first.dim() == 2:
        return tensors, lambda x: x
    if first.dim() != 1:
        raise ValueError(f"token_rewards: expected [B, T] (padded) or [N] (packed), got {tuple(first.shape)}")
    if seq_ids is None or seq_ids.shape != first.shape:
        raise ValueError("seq_ids: a packed (1-D) layout needs the sequence id of every position")
    pos, n_seq, width = _positions(seq_ids)
    ids = seq_ids.long()
    return [_padded(t, ids, n_seq, width, pos) for t in tensors], lambda x: x[ids, pos]


def _padded(x: torch.Tensor, seq_ids: torch.Tensor, n_seq: int, width: int,
            pos: torch.Tensor) -> torch.Tensor:
    """A packed [N] tensor as [n_seq, width] rows (positions of a sequence in order, zeros after)."""
    out = x.new_zeros(n_seq, width)
    out[seq_ids, pos] = x
    return out


def _positions(seq_ids: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(position of every packed entry within its sequence, sequences, longest): the packed layout holds each
    sequence's positions contiguously and in order (ids non-decreasing)."""
    if seq_ids.numel() and bool((seq_ids[1:] < seq_ids[:-1]).any()):
        raise ValueError("seq_ids: a packed layout holds each sequence's positions together, in order (non-decreasing ids)")
    ids = seq_ids.long()
    n_seq = int(ids.max()) + 1 if ids.numel() else 0
    counts = torch.bincount(ids, minlength=n_seq)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(ids.numel(), device=ids.device) - starts[ids]
    return pos, n_seq, int(counts.max()) if n_seq else 0


@register_token_advantage("gae")
def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float,
                   seq_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over each sequence's response tokens:

        delta_t = r_t + gamma * V_{t+1} - V_t        (V after the last token = 0)
        A_t     = delta_t + gamma * lam * A_{t+1}     returns R_t = A_t + V_t

    Positions outside `mask` are skipped (they neither take a value nor break the recursion: the next
    token's value and advantage carry over them, as verl's `compute_gae_advantage_return`). Values and
    rewards are detached; float64 for float64 input, else float32."""
    if token_rewards.shape != values.shape or values.shape != mask.shape:
        raise ValueError(f"token_rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)} and mask "
                         f"{tuple(mask.shape)} must have one shape")
    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lam <= 1.0:
        raise ValueError(f"gamma, lam: must be in [0, 1], got gamma={gamma}, lam={lam}")
    dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
    (r, v, m), unpad = _rows([token_rewards.detach().to(dtype), values.detach().to(dtype), mask.to(dtype)], seq_ids)
    adv = torch.zeros_like(r)
    next_v = r.new_zeros(r.shape[0])  # [rows]: r[:, 0] would not exist for rows of no position
    last = r.new_zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lam * last
        mt = m[:, t]
        last = a * mt + last * (1 - mt)
        next_v = v[:, t] * mt + next_v * (1 - mt)
        adv[:, t] = last
    adv = adv * m
    ret = (adv + v) * m
    return unpad(adv), unpad(ret)


def resolve_normalize_std(estimator: str, normalize_std: Optional[bool]) -> bool:
    """Whether `estimator` divides by the group std: a std-normalisable one does unless told not to; the others
    never do (asking them to is a ValueError)."""
    est = ADVANTAGE_ESTIMATORS.get(estimator)
    if est.std_normalisable:  # a token estimator: whitening over the step's tokens
        return True if normalize_std is None else bool(normalize_std)
    if normalize_std:
        raise ValueError(f"normalize_adv_std: advantage = {estimator!r} is defined without the std division "
                         "(leave normalize_adv_std unset or false; advantage = 'grpo' divides by the std)")
    return False


@dataclass(frozen=True)
class AdvantageSpec:
    """A run's advantages, resolved and validated once."""
    estimator: str
    normalize_std: bool
    drop_equal_reward_groups: bool

    def __post_init__(self) -> None:
        resolve_normalize_std(self.estimator, self.normalize_std)  # unknown name / std where not defined: ValueError

    @classmethod
    def from_config(cls, rl: Any) -> AdvantageSpec:
        """From `[rl]`: dynamic sampling drops equal-reward groups too (and refills the step)."""
        return cls(estimator=rl.advantage, normalize_std=resolve_normalize_std(rl.advantage, rl.advantages.normalize_std),
                   drop_equal_reward_groups=rl.advantages.drop_equal_reward_groups or rl.advantages.dynamic_sampling)
