"""The `[rl]` config section, nested by role: the algorithm selection keys flat in `[rl]` (`policy_loss`,
`advantage`, `rollout_backend`, `routing_replay`, `allocation`, `recompute_logprobs`), the settings of each
part in its own table (`[rl.batch]`, `[rl.rollout]`, `[rl.loss]`, `[rl.advantages]`, `[rl.update]`,
`[rl.reward_pool]`, `[rl.prompts]`, `[rl.asynchronous]`, `[rl.vllm]`), held-out evaluation in `[rl.eval]` and the
verifiers in `[[rl.rewards]]` (one per verifier, `type =` picks it, see rl/rewards/config.py).

The strict loader (megatron_vlm.config) builds `RLConfig` from the `[rl]` TOML table. Each table's
`validate()` checks its own keys; `RLConfig.validate()` the checks across tables, raising ValueError
naming the key (dotted from `[rl]`). A key of the flat layout before the tables (e.g. `rl.group_size`) is
refused with the key it moved to (`MOVED_KEYS`; exit 2), never read silently. Names follow the GRPO / PPO literature and the public recipes (AReaL, verl): a step takes
`prompts_per_step` prompts, samples `group_size` completions for each, and runs `ppo_epochs`
passes of `mini_batches_per_step` optimizer steps over them.

This module must stay free of torch imports: reward worker processes import the rewards package.
"""
from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

from megatron_vlm.errors import ConfigError
from megatron_vlm.rl.asynchronous.allocation import parse_allocation
from megatron_vlm.rl.env.config import RLEnvConfig
from megatron_vlm.rl.rewards.config import (
    ChoiceRewardConfig,
    CustomRewardConfig,
    ExactMatchRewardConfig,
    FormatRewardConfig,
    JudgeRewardConfig,
    MathRewardConfig,
    ModelRewardConfig,
)

__all__ = ["RLConfig", "RLEvalConfig", "RLBatchConfig", "RLRolloutConfig", "RLLossConfig", "RLAdvantagesConfig",
           "RLUpdateConfig", "RLCriticConfig", "RLRewardPoolConfig", "RLPromptsConfig", "RLAsyncConfig", "VLLMConfig", "MOVED_KEYS",
           "ROLLOUT_BACKENDS"]

ROLLOUT_BACKENDS = ("builtin", "vllm")
VLLM_MIN_TEMPERATURE = 0.01
"""vLLM (0.32) samples a temperature in (0, 0.01) at 0.01: such a value is refused with its back end."""

_DEFAULT_PROMPT_TEMPLATE = (
    "{problem} You FIRST think about the reasoning process as an internal monologue and then provide "
    "the final answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final "
    "answer MUST BE put in \\boxed{{}}."
)


@dataclass(kw_only=True)
class RLEvalConfig:
    every_steps: int = 0
    """Evaluate held-out accuracy every N optimizer steps (0 = only before the first and after the
    last step)."""
    at_start: bool = True
    """Also evaluate before the first step (the "before" number of a before / after comparison)."""
    k: int = 1
    """Samples per prompt; the reported accuracy is Avg@k (mean correctness over all k samples)."""
    temperature: float = 0.0
    """Sampling temperature for evaluation (0 = greedy; k > 1 needs temperature > 0)."""
    top_p: float = 1.0
    """Nucleus sampling threshold for evaluation (with eval.temperature > 0; greedy decoding reads none)."""
    max_new_tokens: Optional[int] = None
    """Generation budget for evaluation (unset = rl.rollout.max_new_tokens)."""
    max_prompts: int = 0
    """Evaluate on at most this many held-out prompts (0 = all)."""
    correct_threshold: float = 1.0
    """A sample counts as correct when its accuracy reward is >= this (rewards are in [0, 1]); in (0, 1]."""

    def validate(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"every_steps: must be >= 0, got {self.every_steps}")
        if self.k < 1:
            raise ValueError(f"k: must be >= 1, got {self.k}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if self.k > 1 and self.temperature == 0:
            raise ValueError(f"temperature: k = {self.k} samples per prompt need temperature > 0 (greedy repeats one answer)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_p < 1 and self.temperature == 0:  # greedy decoding takes the argmax: no nucleus to cut
            raise ValueError(f"top_p: {self.top_p} has no effect with temperature = 0 (greedy evaluation); set "
                             "temperature > 0 to sample, or leave top_p at 1")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if not 0 < self.correct_threshold <= 1:  # scores are in [0, 1]: 0 counts every miss, > 1 / NaN no hit
            raise ValueError(f"correct_threshold: must be in (0, 1], got {self.correct_threshold}")
        if self.max_prompts < 0:
            raise ValueError(f"max_prompts: must be >= 0, got {self.max_prompts}")


def _at_least_one(section: Any, name: str) -> None:
    v = getattr(section, name)
    if v < 1:
        raise ValueError(f"{name}: must be >= 1, got {v}")


@dataclass(kw_only=True)
class RLBatchConfig:
    """`[rl.batch]`: How many prompts and samples a step has, and how they are split into optimizer updates."""

    prompts_per_step: int = 32
    """Prompts per GRPO step over all data-parallel ranks; a step has batch.prompts_per_step * batch.group_size samples."""
    group_size: int = 8
    """Completions sampled per prompt (G); the group estimators' advantages are relative within each group
    (advantage = "grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline": G >= 2). 1 is allowed with advantage =
    "gae" (PPO with a critic, whose values are the baseline; verl's PPO with rollout.n = 1) and
    "reinforce_plus_plus" (the batch mean is the baseline), without advantages.drop_equal_reward_groups and
    advantages.dynamic_sampling (every group of one has equal rewards)."""
    ppo_epochs: int = 1
    """Passes over each step's samples."""
    mini_batches_per_step: int = 1
    """Optimizer steps per PPO epoch: the step's samples are split into this many mini-batches
    (1 = fully on-policy update)."""

    def validate(self) -> None:
        for name in ("prompts_per_step", "group_size", "ppo_epochs", "mini_batches_per_step"):
            _at_least_one(self, name)
        samples = self.prompts_per_step * self.group_size
        if self.mini_batches_per_step > samples:
            raise ValueError(
                f"mini_batches_per_step: {self.mini_batches_per_step} mini-batches from "
                f"{samples} samples per step (prompts_per_step * group_size) leaves some empty"
            )


@dataclass(kw_only=True)
class RLRolloutConfig:
    """`[rl.rollout]`: Generation of the step's completions: sampling, budget, the engine's weights, KV cache and decode steps."""

    temperature: float = 1.0
    """Sampling temperature of rollouts; the training log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches rollout.top_p (1 = off). The
    behaviour log-probs stay those of the whole distribution (built-in engine); vLLM reports the truncated one's, so
    with rollout_backend = "vllm" it needs recompute_logprobs = true and is refused with loss.rollout_correction and
    the asynchronous decoupled loss (docs/vllm.md)."""
    top_k: int = 0
    """Keep only the k most likely tokens when sampling, and any tied with the k-th, as transformers and vLLM do (0 =
    off). With rollout_backend = "vllm": as rollout.top_p."""
    max_new_tokens: int = 1024
    """Generation budget per completion; longer completions are cut (and count as truncated)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: generation of a completion ends after the first of these (EOS always stops)."""
    batch_prompts: int = 0
    """Prompts generated together on one rank: the KV cache holds rollout.batch_prompts * batch.group_size
    sequences at once, and a slot is refilled with a waiting sample as soon as its completion ends (every weights
    mode; lock-stepped ranks admit in rounds they make together); 0 = all of the rank's prompts of a step at once."""
    memory_gib: float = 0.0
    """KV-cache budget of one rollout batch per rank, in GiB, used when rollout.batch_prompts = 0:
    prompts per rollout batch = floor(budget / (batch.group_size x data.max_tokens_per_pack cache slots x KV
    bytes per slot)), at least 1 (0 = no budget: all of the rank's prompts at once). Refused with
    rollout.batch_prompts set (that count would win)."""
    weights: str = "shared"
    """Weights the rollout engine generates with. "shared": the trainer's parameters, called through the
    FSDP root (no extra memory, but the parameters are all-gathered at every decoding step and ranks
    decode in lock-step, their slots refilled in admission rounds all ranks make together). "copy": an unsharded inference copy of the
    policy on every rank, refreshed once per step from the trainer (one gather of the full weights per
    step, one more model in memory), decoding with continuous batching (rollout.batch_prompts *
    batch.group_size slots, refilled as completions end) and no collective per token, in CUDA graphs on a GPU
    (rollout.cuda_graphs; "shared" decodes eagerly): the sync recipes that fit use it, and `--check` says when a
    copy would fit a "shared" run. The copy computes as the trainer does (in bf16 its inputs are cast as the
    trainer's mixed precision casts them), so both modes sample from the same policy (one process: the same
    rollouts and logged rows, tests/integration/test_grpo_copy_rows.py). On one CPU device nothing is gathered, so
    "shared" is the cheaper choice there. With parallel.fsdp = false (one process, bf16 weights beside fp32 masters)
    "shared" decodes with the trainer's bf16 weights as the engine's own copy: continuous batching and CUDA graphs as
    "copy", without its memory or refresh. "expert_parallel" (MoE policies with parallel.ep > 1):
    a copy on every rank holding the dense (non-expert) weights unsharded and only this rank's routed experts
    of the training ep layout (inference/ep_rollout.py), refreshed from the trainer once per step (dense
    tensors gathered one at a time, experts copied from the local shard); decoding gathers no weights, the
    MoE blocks exchange tokens between ranks, so ranks decode in lock-step as with "shared". For
    the 30B-A3B recipes, where "copy" does not fit and "shared" gathers the whole model per token. Refused
    with parallel.ep = 1, parallel.backend = "mcore", parallel.tp > 1, [lora], asynchronous GRPO (allocation) and
    rollout_backend = "vllm". With asynchronous GRPO (allocation) the rollout ranks always generate with their own
    copy, which the trainer's weight pushes refresh: this key then chooses only how the training ranks generate the
    held-out evaluation ([rl.eval]), and "copy" loads that copy on the training ranks even for a run without one."""
    cuda_graphs: str = "auto"
    """Decode steps of the rollout engine on static buffers per batch-size bucket (1, 2, 4, ... slots),
    captured once per bucket as CUDA graphs and replayed (one launch per step instead of hundreds of small
    kernels; inference/decode_graphs.py). "auto" (default): on for a CUDA device where the engine holds its own
    weights (rollout.weights = "copy" or "expert_parallel", and the rollout ranks of asynchronous GRPO, whose
    copy the weight pushes write in place, which a graph then reads); eager steps on other devices and where it
    cannot work (logged on CUDA): rollout.weights = "shared" (lock-step FSDP forwards), a failed capture (MoE
    blocks route graph-safely there: models/common/moe_static.py). Measured on an H200 at the 3B shape: 5.1x
    transformers `generate` in graphs, 0.83x with eager steps (benchmarks/RESULTS.md). "on": as "auto", but
    those cases are errors, and on a CPU the same static step runs eagerly (for tests: its first runs are checked
    for host reads). "off": eager steps. Lock-stepped ranks with their own copy ("expert_parallel") run one
    bucket, the slot count, every MoE block exchanging the step's rows with an all-gather and a reduce-scatter
    of fixed size instead of the all-to-all."""
    kv_block_size: int = 0
    """Positions per block of the rollout engine's paged KV cache (0 = the slot cache: every sequence holds
    a slot of the batch's longest prompt + the budget). >= 2: the keys / values live in a pool of blocks
    addressed by a block table (`PagedSlotCache`, models/common/slot_cache.py), allocated on demand as vLLM
    does: an admitted sample takes the blocks of its prompt, a running one another block each time its sequence
    reaches the end of its blocks, a finished one returns them; when the pool is out of blocks the sample
    admitted last is preempted and later continues from its prompt + generated tokens prefilled again
    (rollout/preemptions counts them), lock-stepped ranks ("shared" / "expert_parallel") too (in their admission
    rounds). Same tokens and log-probs as the slot cache
    (float rounding aside) with a pool that never preempts; runs in CUDA graphs too (rollout.cuda_graphs: the
    block table is a static buffer); on the CPU ~5-9 % slower. Attention-only decoders: refused for the Mamba2
    hybrid (Nemotron-VL, its recurrent state is per slot) and with [rl.env] (multi-turn conversations keep a slot
    across turns). Read by every engine of the job: synchronous and asynchronous GRPO rollouts and [rl.eval]."""
    kv_cache_blocks: int = 0
    """Blocks in the paged KV cache's pool (with rollout.kv_block_size >= 2; 0 = derived: 1 + slots x
    ceil((longest prompt + budget) / rollout.kv_block_size), room for every slot at full length, plus the admission
    headroom (~1 %), so memory is the slot cache's and samples are admitted, and draw, as there). Set: the pool fixes the rollout's KV memory whatever the slot count
    (rollout.batch_prompts x batch.group_size) and a waiting sample is admitted when the blocks of its prompt
    are free besides a headroom of 1 % of the pool, so many more slots than full-length sequences fit can run
    (set rollout.batch_prompts large: completions shorter than the budget hold only what they generated);
    sampled tokens then differ from the slot cache's, since a sample's random numbers follow its slot and
    step; --check plans the pool's memory. Every weights mode (lock-stepped ranks admit in rounds they make
    together). Needs room for one sample: >= 1 + ceil(data.max_tokens_per_pack /
    rollout.kv_block_size) (one block is the engine's scratch row)."""

    def validate(self) -> None:
        _at_least_one(self, "max_new_tokens")
        if self.weights not in ("shared", "copy", "expert_parallel"):
            raise ValueError(f"weights: must be 'shared', 'copy' or 'expert_parallel', got {self.weights!r}")
        if self.cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graphs: must be 'auto', 'on' or 'off', got {self.cuda_graphs!r}")
        self._validate_paged_kv()
        if self.batch_prompts < 0:
            raise ValueError(f"batch_prompts: must be >= 0 (0 = all at once), got {self.batch_prompts}")
        if self.temperature <= 0:
            raise ValueError(f"temperature: must be > 0 for GRPO sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (0 = off), got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop: stop strings must not be empty")
        if not self.memory_gib >= 0 or self.memory_gib == float("inf"):
            raise ValueError(f"memory_gib: must be finite and >= 0 (0 = no budget), got {self.memory_gib}")
        if self.memory_gib and self.batch_prompts:  # the budget only sizes a batch whose count is not given
            raise ValueError(f"memory_gib: {self.memory_gib} GiB sizes the rollout batch only when batch_prompts = 0; "
                             f"batch_prompts = {self.batch_prompts} sets the count directly (remove one of them)")

    def _validate_paged_kv(self) -> None:
        """`kv_block_size` / `kv_cache_blocks` and the rollout modes that cannot use the paged KV cache (the
        model-dependent refusal, Mamba2 hybrid decoders, is the engine's: inference/policy_engine.py)."""
        if self.kv_block_size < 0 or self.kv_block_size == 1:
            raise ValueError(f"kv_block_size: must be 0 (the slot cache) or >= 2 positions per block (one block "
                             f"also holds the engine's scratch row of 2 positions), got {self.kv_block_size}")
        if self.kv_cache_blocks < 0:
            raise ValueError(f"kv_cache_blocks: must be >= 0 (0 = derived from the slots), got {self.kv_cache_blocks}")
        if self.kv_cache_blocks and not self.kv_block_size:
            raise ValueError(f"kv_cache_blocks: {self.kv_cache_blocks} sizes the paged KV cache, which is off "
                             "(kv_block_size = 0); set kv_block_size >= 2 too, or leave kv_cache_blocks 0")


@dataclass(kw_only=True)
class RLLossConfig:
    """`[rl.loss]`: The settings of the policy loss that `policy_loss` selects (megatron_vlm/rl/losses.py)."""

    clip_ratio_low: float = 0.2
    """PPO clip range below 1: the ratio is clipped to at least 1 - loss.clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """PPO clip range above 1: the ratio is clipped to at most 1 + loss.clip_ratio_high (DAPO's
    "clip-higher" uses e.g. 0.28)."""
    loss_agg: Literal["token-mean", "seq-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """Loss aggregation: token-mean averages over all response tokens of the mini-batch; seq-mean
    averages each sequence's tokens first, then over sequences; seq-mean-token-sum-norm sums over all
    tokens and divides by the constant rollout.max_new_tokens x sequences (Dr. GRPO, Liu et al. 2025)."""
    kl_coef: float = 0.0
    """Coefficient of the KL penalty against the frozen reference model; 0 drops the reference model. With
    advantage = "gae" (PPO with a critic) and "reinforce_plus_plus" the penalty is not in the loss but in the
    per-token reward, -kl_coef x KL_t of the policy that generated the samples (the old log-probs; the rollout's
    own with stale samples of asynchronous GRPO) against the reference (PPO-RLHF,
    REINFORCE++; loss.kl_estimator, the papers' is k1), which the critic learns to predict / which enters
    REINFORCE++'s returns; actor/kl is still logged. With every other estimator (reinforce_plus_plus_baseline
    included, as its paper) it is a loss term. advantages.kl_in_reward moves it for the REINFORCE++ estimators."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """KL estimator per token: k1 = log pi - log pi_ref; k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1
    (non-negative, unbiased). Read only with loss.kl_coef > 0 (another value with 0 is refused)."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss subtracts loss.entropy_coef x the policy entropy aggregated like the loss."""
    rollout_correction: Literal["none", "tis", "mis"] = "none"
    """Rollout / training mismatch correction (rollout numerics differ from training's; Yao et al. 2025,
    "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"): "tis" multiplies each
    token's loss by min(pi_train_old / pi_rollout, C); "mis" drops sequences whose geometric-mean ratio
    lies outside [1/C, C]. Needs recompute_logprobs = true (the training-side old log-probs). The
    mismatch KL and ratio min / mean / max are logged whenever recompute_logprobs is on."""
    rollout_correction_cap: float = 2.0
    """C of loss.rollout_correction (> 1; read only with "tis" or "mis")."""
    behav_imp_weight_cap: Optional[float] = None
    """Asynchronous GRPO with asynchronous.max_head_offpolicyness > 0 (decoupled PPO loss): tokens whose importance
    weight pi_prox / pi_behav exceeds this cap get weight 0 (kept in the normaliser, counted as
    actor/behav_capped_frac); unset = no cap."""

    def validate(self) -> None:
        choices = {"loss_agg": ("token-mean", "seq-mean", "seq-mean-token-sum-norm"), "rollout_correction": ("none", "tis", "mis")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: must be one of {list(allowed)}, got {getattr(self, name)!r}")
        if not 0 <= self.clip_ratio_low < 1:
            raise ValueError(f"clip_ratio_low: must be in [0, 1), got {self.clip_ratio_low}")
        if self.clip_ratio_high < 0:
            raise ValueError(f"clip_ratio_high: must be >= 0, got {self.clip_ratio_high}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef: must be >= 0, got {self.kl_coef}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef: must be >= 0, got {self.entropy_coef}")
        if self.rollout_correction_cap <= 1:
            raise ValueError(f"rollout_correction_cap: must be > 1, got {self.rollout_correction_cap}")
        if self.rollout_correction == "none" and self.rollout_correction_cap != RLLossConfig.rollout_correction_cap:
            raise ValueError(f"rollout_correction_cap: {self.rollout_correction_cap} is only read with "
                             "rollout_correction = 'tis' or 'mis'; set one or remove it")
        if self.behav_imp_weight_cap is not None and self.behav_imp_weight_cap <= 1:
            raise ValueError(f"behav_imp_weight_cap: must be > 1, got {self.behav_imp_weight_cap}")


@dataclass(kw_only=True)
class RLAdvantagesConfig:
    """`[rl.advantages]`: What enters the advantages of the estimator that `advantage` selects: its std division, the groups kept (DAPO's dynamic sampling) and DAPO's overlong shaping."""

    normalize_std: Optional[bool] = None
    """Divide group-relative advantages by the group's reward standard deviation. Unset = the
    estimator's definition (grpo: true; dr_grpo, rloo: false); false with grpo keeps mean-centred
    rewards only; true with dr_grpo or rloo is refused. With gae (PPO): whiten the token advantages over the
    step's tokens (mean 0, std 1; unset = true), as verl and TRL do. With reinforce_plus_plus(_baseline): divide
    by the std of the step's token advantages on all ranks after subtracting their mean (unset = true; false:
    the mean only)."""
    drop_equal_reward_groups: bool = False
    """Drop groups whose G rewards are all equal (they carry no learning signal) without sampling more
    (advantages.dynamic_sampling refills the step)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025): groups whose rewards are all equal are dropped and more
    prompts are generated (batch.prompts_per_step per round, drawn from the training set) until the step has
    batch.prompts_per_step groups with non-zero reward variance or advantages.max_sampling_rounds rounds ran; surplus
    groups of the last round are dropped. Rounds and dropped groups are logged (sampling/*)."""
    max_sampling_rounds: int = 3
    """Dynamic sampling: at most this many generation rounds per step (the first included); a step
    that still has fewer informative groups trains on those it has (sampling/kept_groups says so). Read only with
    advantages.dynamic_sampling = true."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: the last advantages.overlong_buffer tokens of the rollout.max_new_tokens budget,
    over which the penalty rises linearly from 0 to advantages.overlong_penalty (0 = off). Refused with [rl.env] (the
    budget is one model turn's, a trajectory's model tokens span several)."""
    overlong_penalty: float = 0.0
    """Reward subtracted at rollout.max_new_tokens (DAPO uses 1.0); needs advantages.overlong_buffer >= 1."""
    gamma: Optional[float] = None
    """Discount over the response tokens of GAE (advantage = "gae") and of REINFORCE++'s returns (advantage =
    "reinforce_plus_plus"); unset = 1.0, no discount: the reward sits on the last token. In [0, 1]. Refused with
    the other estimators, and below 1 with policy_loss = "gspo" (each token would get its own return)."""
    lam: Optional[float] = None
    """GAE's lambda, the bias / variance trade-off of the advantage (advantage = "gae" only; unset = 0.95, TRL's
    PPO default; 1 = Monte-Carlo returns minus the values, 0 = one-step TD errors). In [0, 1]."""
    kl_in_reward: Optional[bool] = None
    """Where loss.kl_coef's KL penalty goes (verl's algorithm.use_kl_in_reward): true = into the per-token rewards,
    -loss.kl_coef x KL_t on every response token, and out of the loss; false = a loss term. Unset = the estimator's
    own: true for "gae" and "reinforce_plus_plus", false for the others. With "reinforce_plus_plus_baseline" true makes
    each token's advantage its return: the group-centred reward on the last token plus the KL penalties from that
    token on (no discount), then the same global whitening. Read only with loss.kl_coef > 0 (set with 0 it is
    refused). Refused: true with "grpo", "dr_grpo", "rloo" (one advantage per completion, no per-token reward);
    false with "gae" (the critic learns the rewards with the penalty in them); in effect (true, or unset with
    "reinforce_plus_plus") with policy_loss = "gspo" (per-token returns; gspo takes one advantage per sequence). The
    one coefficient goes to one place: never both the reward and the loss."""

    def validate(self) -> None:
        for name in ("gamma", "lam"):
            v = getattr(self, name)
            if v is not None and not 0.0 <= v <= 1.0:
                raise ValueError(f"{name}: must be in [0, 1], got {v}")
        if self.max_sampling_rounds < 1:
            raise ValueError(f"max_sampling_rounds: must be >= 1, got {self.max_sampling_rounds}")
        if not self.dynamic_sampling and self.max_sampling_rounds != RLAdvantagesConfig.max_sampling_rounds:
            raise ValueError(f"max_sampling_rounds: {self.max_sampling_rounds} is only read with dynamic_sampling = true "
                             "(a step generates one round otherwise); set it or remove max_sampling_rounds")
        if self.overlong_buffer < 0:
            raise ValueError(f"overlong_buffer: must be >= 0 (0 = off), got {self.overlong_buffer}")
        if self.overlong_penalty < 0:
            raise ValueError(f"overlong_penalty: must be >= 0, got {self.overlong_penalty}")
        if (self.overlong_buffer > 0) != (self.overlong_penalty > 0):
            raise ValueError(f"overlong_penalty: the soft overlong penalty needs both overlong_buffer >= 1 and "
                             f"overlong_penalty > 0 (one alone has no effect), got overlong_buffer = "
                             f"{self.overlong_buffer}, overlong_penalty = {self.overlong_penalty}")


@dataclass(kw_only=True)
class RLCriticConfig:
    """`[rl.critic]`: PPO's critic (advantage = "gae"): a value head on a backbone, trained beside the policy
    with its own optimizer (megatron_vlm/rl/critic/)."""

    PATHS: ClassVar[tuple[str, ...]] = ("model",)  # filesystem paths: a leading ~ is expanded (config/loader.py)

    model: str = "policy"
    """The critic's backbone: "policy" = a copy of the policy's starting weights (model.path), or the path of
    another model folder of the policy's family sharing its tokenizer and image settings (e.g. a smaller one).
    A scalar Linear value head on its final hidden states is added (initialised to 0: every value starts at 0).
    Its trainable layers are train.train_layers' (the lm_head is never trained: its output is not read)."""
    lr: float = 1e-5
    """AdamW learning rate of the critic (constant; betas, eps and weight decay are [optimizer]'s)."""
    value_clip: float = 0.2
    """eps of the clipped value loss: a new value may move at most this far from the value the rollout was
    scored with before its squared error stops shrinking (PPO2 / TRL; 0 = no clipping)."""
    warmup_steps: int = 0
    """Steps at the start of the run in which only the critic is trained (the policy does not move; its lr
    schedule still counts them), so that the first policy updates see fitted values."""
    value_loss: str = "clipped"
    """The value loss (megatron_vlm/rl/algorithms/value_losses.py), aggregated like the policy loss
    (loss.loss_agg)."""

    def validate(self) -> None:
        if not self.model:
            raise ValueError("model: must be 'policy' or a model folder")
        if not self.lr > 0 or self.lr == float("inf"):
            raise ValueError(f"lr: must be finite and > 0, got {self.lr}")
        if not self.value_clip >= 0 or self.value_clip == float("inf"):
            raise ValueError(f"value_clip: must be finite and >= 0 (0 = no clipping), got {self.value_clip}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: must be >= 0, got {self.warmup_steps}")
        from megatron_vlm.rl.algorithms.value_losses import VALUE_LOSSES

        if self.value_loss not in VALUE_LOSSES:
            raise ValueError(f"value_loss: must be one of {VALUE_LOSSES.names()}, got {self.value_loss!r}")


@dataclass(kw_only=True)
class RLUpdateConfig:
    """`[rl.update]`: The training forwards of the update: what they pack and skip, and where the reference model lives."""

    prompt_sharing: str = "auto"
    """Training forwards (policy update, old and reference log-probs) with each prompt packed once for
    the completions of its group instead of once per completion: the same log-probs and gradients up to
    float rounding, with the prompt's projections, MLPs and images computed once (G times less prompt
    work). "auto": where the decoder supports it (attention-only decoders, not Nemotron-VL's Mamba2
    hybrid), tensor / context parallelism are off and the MoE auxiliary loss is (moe.aux_loss_coef = 0: it is a
    function of every token a pack routes, a shared prompt's once instead of once per completion; the startup log says
    which; off with batch.group_size = 1: no prompt has two completions); "off": every completion packed with its own
    copy of the prompt. With prompts shared a MoE policy's expert
    loads (moe/* metrics, score-correction biases) count a prompt's tokens once per group."""
    skip_zero_advantage: bool = True
    """Leave completions whose advantage is exactly 0 (every completion of a group whose rewards are all
    equal, under grpo's std normalisation or not) out of the update's forwards and backwards, and out of
    the old-log-prob forward (recompute_logprobs; except with loss.rollout_correction = "mis", whose drops
    read every sample's old log-probs). Their loss
    and gradient are exactly 0, and the normaliser (tokens / sequences of the mini-batch) still counts
    them, so the update is the same up to float rounding (packs hold other samples; with LoRA dropout, other
    random masks) for a fraction of
    the compute: late in training most groups are often solved or hopeless. Applied only where it is
    exact: no KL term (loss.kl_coef = 0), no entropy bonus, no per-token advantages (advantage = "gae",
    "reinforce_plus_plus", "reinforce_plus_plus_baseline"), no MoE layers (their auxiliary loss and load
    statistics see every token); a mini-batch with nothing left still runs one zero-gradient forward, so
    the optimizer steps as it would have. The actor/* metrics (entropy, clip fractions) then cover the
    trained completions only; false: every completion is forwarded (unlike advantages.drop_equal_reward_groups,
    neither setting changes the normaliser)."""
    mask_truncated: bool = False
    """Exclude completions cut at rollout.max_new_tokens from the loss (DAPO's overlong filtering); they still
    count in their group's advantages."""
    ref_offload: bool = False
    """Keep the reference model's weights on CPU and move them to the device only to score a batch."""

    def validate(self) -> None:
        if self.prompt_sharing not in ("auto", "off"):
            raise ValueError(f"prompt_sharing: must be 'auto' or 'off', got {self.prompt_sharing!r}")


@dataclass(kw_only=True)
class RLRewardPoolConfig:
    """`[rl.reward_pool]`: The worker processes that run the verifiers of `[[rl.rewards]]`, and their limits
    (timeout_s, batch_timeout_s and abs_max are the verifier calls' only: refused without a `[[rl.rewards]]` table,
    where the [rl.env] environment's rewards are the whole reward)."""

    workers: int = 2
    """Worker processes that run verifier calls (per rank that scores rewards)."""
    timeout_s: float = 10.0
    """Time limit of one verifier call; a call that exceeds it (or raises) scores 0 and is counted."""
    batch_timeout_s: float = 300.0
    """Deadline of one batch of verifier calls (a step's or an evaluation's scoring on one rank), from
    its first call: calls still unfinished then score 0 and count as timeouts, so a step waits at most
    this long for rewards, not (number of calls) x reward_pool.timeout_s."""
    memory_limit_mb: int = 4096
    """Address-space cap (RLIMIT_AS) of each reward worker process, interpreter and sympy included;
    a verifier that exceeds it fails (scores 0, counted) instead of exhausting the node (0 = no cap). The
    [rl.env] environment workers get the same cap (an environment past it ends its trajectory as env_error).
    A platform that does not enforce the cap refuses a non-zero value when the workers start (exit 2)."""
    abs_max: float = 10.0
    """A verifier value beyond +-reward_pool.abs_max (inf included) is clipped to it and counted
    (`reward/clipped`). Keeps one custom verifier's 1e30 or inf from swamping the advantages or overflowing the
    loss. NaN is no value: the call fails (scores 0, counted in `reward/errors`)."""
    max_failed_steps: int = 5
    """Steps in a row without a usable reward before the run stops with exit code 1 and one line naming this key,
    the cause, the count and the last error (0 = never stop): steps in which every reward call failed (raised,
    timed out or returned NaN) or every [rl.env] environment episode failed (env_error, not trained). Such a step
    trains on nothing; one alone never stops the run, a step with a usable reward resets the count. The run saves a
    checkpoint first when steps with a reward since the newest checkpoint would otherwise be lost."""

    def validate(self) -> None:
        _at_least_one(self, "workers")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.memory_limit_mb < 0 or 0 < self.memory_limit_mb < 256:
            raise ValueError(f"memory_limit_mb: 0 (no cap) or >= 256 (the interpreter and sympy need some), "
                             f"got {self.memory_limit_mb}")
        if not self.batch_timeout_s > 0 or self.batch_timeout_s == float("inf"):
            raise ValueError(f"batch_timeout_s: must be finite and > 0, got {self.batch_timeout_s}")
        if not self.abs_max > 0 or self.abs_max == float("inf"):
            raise ValueError(f"abs_max: must be finite and > 0, got {self.abs_max}")
        if self.max_failed_steps < 0:
            raise ValueError(f"max_failed_steps: must be >= 0 (0 = never stop), got {self.max_failed_steps}")


@dataclass(kw_only=True)
class RLPromptsConfig:
    """`[rl.prompts]`: How a dataset question becomes the chat's user turn."""

    template: str = _DEFAULT_PROMPT_TEMPLATE
    """Template of the user turn; `{problem}` is replaced by the dataset's question text
    (literal braces are written `{{` `}}`)."""
    system_prompt: Optional[str] = None
    """Optional system turn of the chat. A prompt row that brings its own system turn (chat-messages, verl and TRL
    conversational rows) keeps it; how many rows did is logged as a warning at start-up."""

    def validate(self) -> None:
        if "{problem}" not in self.template:
            raise ValueError("template: must contain the {problem} placeholder")
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None]
            self.template.format(problem="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"template: only {{problem}} may be a placeholder (write literal braces as {{{{ }}}}): {e!r}"
            ) from None
        if any(f != "problem" for f in fields):  # {problem.upper} would render an attribute of the text, not the text
            bad = sorted({f for f in fields if f != "problem"})
            raise ValueError(f"template: only {{problem}} may be a placeholder, got {bad} (write literal braces as "
                             "{{ }})")


@dataclass(kw_only=True)
class RLAsyncConfig:
    """`[rl.asynchronous]`: Asynchronous GRPO (`allocation` set): the staleness bound."""

    max_head_offpolicyness: int = 0
    """Asynchronous GRPO (`allocation` set): how many policy versions the oldest token of a trained
    sample may lag the trainer (version = GRPO steps done). A rollout rank does not start the prompts
    of step b before it holds version b - asynchronous.max_head_offpolicyness, so every token of a sample trained at
    step s was drawn by a version >= s - asynchronous.max_head_offpolicyness. 0 = synchronous: the same results as
    the synchronous loop; > 0 trains with the decoupled PPO loss (proximal = the trainer's log-probs
    before the update, behaviour = the rollout's, weight capped by loss.behav_imp_weight_cap)."""

    def validate(self) -> None:
        if self.max_head_offpolicyness < 0:
            raise ValueError(f"max_head_offpolicyness: must be >= 0, got {self.max_head_offpolicyness}")


@dataclass(kw_only=True)
class VLLMConfig:
    """`[rl.vllm]`: The vLLM rollout engine (`rollout_backend = "vllm"`; megatron_vlm/inference/vllm_engine.py).

    The keys are vLLM's own `LLM(...)` arguments where one exists, so a user coming from verl / TRL / OpenRLHF
    finds the names they know. `validate()` holds what the TOML alone decides; `device_blocker()` what needs
    the device (sleep mode needs CUDA); RLConfig checks the keys of other tables that depend on the back end."""

    tensor_parallel_size: int = 1
    """Tensor-parallel size of each rollout engine. Every rank runs its own in-process engine with one worker;
    with a value above 1 the engines of `tensor_parallel_size` consecutive ranks form one sharded engine
    (vLLM's external-launcher executor). It must equal `parallel.tp`, whose groups hold the same prompts
    (synchronous GRPO; 1 with rl.allocation); otherwise exit 2 (inference/vllm_layout.py, docs/vllm.md)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of the device memory vLLM may take for weights + KV cache (CUDA only; in (0, 1]).
    Colocated with training (synchronous GRPO): leave room for the trainer. On the CPU the KV cache is
    sized by `vllm.cpu_kv_cache_gib` instead: set there, this key is refused when the engine starts (exit 2)."""
    cpu_kv_cache_gib: float = 1.0
    """CPU builds of vLLM: KV-cache size in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE, an integer >= 1 there:
    rounded up; this key sets it, replacing a value already in the environment). Set on another device, refused
    when the engine starts (exit 2)."""
    enforce_eager: bool = False
    """Run the model eagerly (no torch.compile / CUDA graphs): slower decoding, faster start. The CPU
    build always gets eager mode here (its compile step takes minutes on small machines)."""
    max_num_seqs: int = 256
    """Sequences decoded together (vLLM's batch limit)."""
    max_model_len: Optional[int] = None
    """Prompt + completion tokens the engine accepts; unset = data.max_tokens_per_pack, below it exit 2 (vLLM would end
    completions at this length, short of rollout.max_new_tokens)."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (the n = batch.group_size samples of one prompt share it).
    Reset after every weight push."""
    sleep_mode: bool = False
    """Put the engine to sleep (vLLM's sleep mode) while the trainer runs, giving its device memory back;
    needs CUDA (exits 2 on other devices) and the synchronous loop (exits 2 with rl.allocation, whose rollout ranks
    never sleep)."""
    sleep_level: int = 1
    """Sleep level with vllm.sleep_mode: 1 = offload the weights to host memory and drop the KV cache,
    2 = drop both (the next weight push refills them). 1 or 2."""
    weight_bucket_mb: int = 256
    """Weight push: tensors are sent to the engine in buckets of at most this many MiB (a tensor larger
    than that is a bucket of its own), gathered from the trainer's shards one bucket at a time."""

    def validate(self) -> None:
        _at_least_one(self, "tensor_parallel_size")  # the layout (parallel.tp, processes) is checked with the job's
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0 < self.cpu_kv_cache_gib < float("inf"):
            raise ValueError(f"cpu_kv_cache_gib: must be finite and > 0, got {self.cpu_kv_cache_gib}")
        _at_least_one(self, "max_num_seqs")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2 (or unset), got {self.max_model_len}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"sleep_level: must be 1 or 2, got {self.sleep_level}")
        if self.sleep_level != 1 and not self.sleep_mode:
            raise ValueError("sleep_level: only read with sleep_mode = true; set sleep_mode or leave sleep_level unset")
        _at_least_one(self, "weight_bucket_mb")

    def device_blocker(self, device_type: str) -> Optional[str]:
        """Why this config cannot run on a `device_type` device, naming the key; None when it can."""
        if self.sleep_mode and device_type != "cuda":
            return f"rl.vllm.sleep_mode: vLLM's sleep mode needs CUDA (this job runs on {device_type}); set it to false"
        # each device sizes the engine's memory from its own key (inference/vllm_engine.py): the other one would do nothing
        defaults = VLLMConfig()
        if device_type != "cuda" and self.gpu_memory_utilization != defaults.gpu_memory_utilization:
            return (f"rl.vllm.gpu_memory_utilization: read on CUDA only (this job runs on {device_type}"
                    + (", where rl.vllm.cpu_kv_cache_gib sizes the KV cache" if device_type == "cpu" else "")
                    + "); remove it")
        if device_type != "cpu" and self.cpu_kv_cache_gib != defaults.cpu_kv_cache_gib:
            return (f"rl.vllm.cpu_kv_cache_gib: read by vLLM's CPU build only (this job runs on {device_type}"
                    + (", where rl.vllm.gpu_memory_utilization sizes the engine" if device_type == "cuda" else "")
                    + "); remove it")
        return None


MOVED_KEYS: dict[str, str] = {
    "prompts_per_step": "batch.prompts_per_step",
    "group_size": "batch.group_size",
    "ppo_epochs": "batch.ppo_epochs",
    "mini_batches_per_step": "batch.mini_batches_per_step",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "top_k": "rollout.top_k",
    "max_new_tokens": "rollout.max_new_tokens",
    "stop": "rollout.stop",
    "rollout_batch_prompts": "rollout.batch_prompts",
    "rollout_memory_gib": "rollout.memory_gib",
    "rollout_weights": "rollout.weights",
    "rollout_cuda_graphs": "rollout.cuda_graphs",
    "kv_block_size": "rollout.kv_block_size",
    "kv_cache_blocks": "rollout.kv_cache_blocks",
    "clip_ratio_low": "loss.clip_ratio_low",
    "clip_ratio_high": "loss.clip_ratio_high",
    "loss_agg": "loss.loss_agg",
    "kl_coef": "loss.kl_coef",
    "kl_estimator": "loss.kl_estimator",
    "entropy_coef": "loss.entropy_coef",
    "rollout_correction": "loss.rollout_correction",
    "rollout_correction_cap": "loss.rollout_correction_cap",
    "behav_imp_weight_cap": "loss.behav_imp_weight_cap",
    "normalize_adv_std": "advantages.normalize_std",
    "drop_equal_reward_groups": "advantages.drop_equal_reward_groups",
    "dynamic_sampling": "advantages.dynamic_sampling",
    "max_sampling_rounds": "advantages.max_sampling_rounds",
    "overlong_buffer": "advantages.overlong_buffer",
    "overlong_penalty": "advantages.overlong_penalty",
    "prompt_sharing": "update.prompt_sharing",
    "skip_zero_advantage": "update.skip_zero_advantage",
    "mask_truncated": "update.mask_truncated",
    "ref_offload": "update.ref_offload",
    "reward_workers": "reward_pool.workers",
    "reward_timeout_s": "reward_pool.timeout_s",
    "reward_batch_timeout_s": "reward_pool.batch_timeout_s",
    "reward_memory_limit_mb": "reward_pool.memory_limit_mb",
    "reward_abs_max": "reward_pool.abs_max",
    "prompt_template": "prompts.template",
    "system_prompt": "prompts.system_prompt",
    "max_head_offpolicyness": "asynchronous.max_head_offpolicyness",
}
"""Keys of the flat `[rl]` layout -> where they live now (dotted from `[rl]`): an old config fails with the new
name instead of being read under the old one."""



class _DefaultRewards(list):
    """`rl.rewards` when no `[[rl.rewards]]` table is given: the math verifier, or none with [rl.env] (told apart from
    the same list written out, which is kept)."""


@dataclass(kw_only=True)
class RLConfig:
    MOVED: ClassVar[dict[str, str]] = MOVED_KEYS
    """The loader refuses these keys naming their new place (megatron_vlm/config/loader.py)."""

    # --- selection keys (flat in [rl]) -----------------------------------------------------------
    policy_loss: str = "clip"
    """Policy-gradient loss (megatron_vlm/rl/losses.py): "clip" = PPO / GRPO clipped token ratio;
    "gspo" = GSPO (Zheng et al. 2025): the sequence ratio exp(mean_t (log pi - log pi_old)), clipped
    per sequence — its paper uses tiny clip ranges, loss.clip_ratio_low = 3e-4, loss.clip_ratio_high = 4e-4,
    and loss.loss_agg = "seq-mean"; "gspo_token" = GSPO-token (the sequence ratio with per-token
    advantages); "cispo" = CISPO (MiniMax-M1 2025): clipped, detached importance weight x advantage x
    log pi, every token keeps its gradient. loss.clip_ratio_low / loss.clip_ratio_high are the ranges of all four.
    More register by name: megatron_vlm/rl/algorithms/policy_losses.py."""
    advantage: str = "grpo"
    """Advantage estimator (megatron_vlm/rl/advantages.py): "grpo" = group mean-centred reward divided by
    the group std (advantages.normalize_std); "dr_grpo" = mean-centred, no std division (Dr. GRPO, Liu et al.
    2025; pair it with loss.loss_agg = "seq-mean-token-sum-norm"); "rloo" = reward minus the mean of the
    other G - 1 rewards of the group (Ahmadian et al. 2024); "gae" = PPO with a critic: per-token GAE
    advantages over the values of a learned value model ([rl.critic], advantages.gamma / advantages.lam; the
    KL penalty then moves into the per-token reward); "reinforce_plus_plus" = REINFORCE++ (Hu et al. 2025): per-token
    returns of the reward on the last token and the KL penalty -loss.kl_coef x KL_t on every token (discounted by
    advantages.gamma), whitened over every response token of the step on all data-parallel ranks, no critic,
    batch.group_size 1 allowed; "reinforce_plus_plus_baseline" = REINFORCE++ with baseline: reward minus its group's
    mean, whitened the same way (KL in the loss unless advantages.kl_in_reward = true; G >= 2). More register by name:
    megatron_vlm/rl/algorithms/advantage_estimators.py."""
    rollout_backend: str = "builtin"
    """The engine that generates the rollouts: "builtin" = the policy engine of megatron_vlm/inference
    (decodes with the policy model itself, in this process); "vllm" = an in-process vLLM engine on every
    generating rank, fed the trainer's weights after every optimizer step (inference/vllm_engine.py,
    docs/vllm.md; its settings are [rl.vllm], the vllm package must be importable)."""
    routing_replay: str = "off"
    """MoE routing replay ("R3"): "off" = the training forwards route tokens themselves; "rollout" = the
    built-in engine records the top-k experts of every prompt and generated token per MoE layer (int8 / int16,
    on the sample) and the training forwards (old-log-prob recompute, update) route each token to them, the
    gate weights recomputed from the current router scores of those experts (the router keeps its gradient;
    models/common/routing_replay.py). Either way a MoE policy logs rollout/routing_mismatch_frac (tokens x
    layers whose top-k set differs between rollout and the training forward without replay). Native and
    megatron-core MoE layers, context parallelism, multi-turn [rl.env] trajectories (the environment's tokens
    too); not with pipeline parallelism, rollout_backend = "vllm" or a policy without MoE layers (exit 2)."""
    recompute_logprobs: bool = False
    """Recompute the old-policy log-probs of the PPO ratio with a training-layout forward pass before
    the update, instead of taking the rollout engine's behaviour log-probs (one extra forward over the
    step's samples; worth it when rollout numerics differ from training's, e.g. bf16 KV-cache decoding
    against fp32 training, or an external engine)."""
    allocation: Optional[str] = None
    """Asynchronous GRPO: split the job's processes into rollout and training ranks,
    "rollout:N+train:M" (N + M = number of processes; the AReaL spelling "vllm:dN+dM" names vLLM for
    the rollout ranks: it needs rollout_backend = "vllm"; "rollout:N+train:M" with rollout_backend = "vllm" too). Rollout ranks generate continuously with their own copy of the policy and score the
    completions; training ranks (the first M global ranks) train on completed groups and push the
    new weights after every step (megatron_vlm/rl/asynchronous/allocation.py, rl/README.md). Unset = the
    synchronous loop on every rank."""

    # --- the parts' settings ---------------------------------------------------------------------
    batch: RLBatchConfig = field(default_factory=RLBatchConfig)
    """Prompts, samples and optimizer updates per step ([rl.batch])."""
    rollout: RLRolloutConfig = field(default_factory=RLRolloutConfig)
    """Generation ([rl.rollout])."""
    loss: RLLossConfig = field(default_factory=RLLossConfig)
    """The policy loss's settings ([rl.loss])."""
    advantages: RLAdvantagesConfig = field(default_factory=RLAdvantagesConfig)
    """Advantages, kept groups, overlong shaping ([rl.advantages])."""
    update: RLUpdateConfig = field(default_factory=RLUpdateConfig)
    """The update's training forwards ([rl.update])."""
    critic: RLCriticConfig = field(default_factory=RLCriticConfig)
    """PPO's critic ([rl.critic]; read only with advantage = "gae")."""
    reward_pool: RLRewardPoolConfig = field(default_factory=RLRewardPoolConfig)
    """The verifier worker processes ([rl.reward_pool])."""
    prompts: RLPromptsConfig = field(default_factory=RLPromptsConfig)
    """The user turn ([rl.prompts])."""
    asynchronous: RLAsyncConfig = field(default_factory=RLAsyncConfig)
    """Asynchronous GRPO's staleness bound ([rl.asynchronous])."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """The vLLM engine's settings ([rl.vllm]; read only with rollout_backend = "vllm")."""

    # --- rewards and evaluation ------------------------------------------------------------------
    rewards: list[MathRewardConfig | ChoiceRewardConfig | FormatRewardConfig | ExactMatchRewardConfig | CustomRewardConfig
                  | ModelRewardConfig | JudgeRewardConfig] = field(default_factory=lambda: _DefaultRewards([MathRewardConfig()]))
    """Verifiers whose weighted sum is the reward, one `[[rl.rewards]]` table each (`type =` picks it). No table: the
    math verifier, or with [rl.env] none (the environment's turn rewards are the whole reward; an environment that
    gives none, as the built-in tool environments, is refused naming this key)."""
    accuracy_reward: Optional[str] = None
    """Label of the reward reported as accuracy (and used by evaluation); unset = the first reward, or with [rl.env]
    and no [[rl.rewards]] table "env" (the environment's return; "env" may be given with [rl.env] in any case)."""
    model_path_hint: Optional[str] = None
    """Shown when model.path has no model yet: how to produce it (e.g. the SFT run a GRPO demo starts from)."""
    eval: RLEvalConfig = field(default_factory=RLEvalConfig)
    """Held-out evaluation ([rl.eval])."""
    env: Optional[RLEnvConfig] = None
    """Multi-turn rollouts with an environment or tools ([rl.env]; megatron_vlm/rl/env/, docs/environments.md);
    absent = single-turn completions."""

    def validate(self) -> None:
        for name in ("batch", "rollout", "loss", "advantages", "update", "critic", "reward_pool", "prompts", "asynchronous",
                     "vllm", "eval"):
            try:
                getattr(self, name).validate()
            except ValueError as e:
                raise type(e)(f"{name}.{e}") from None
        self._validate_selection()
        self._validate_groups()
        self._validate_critic()
        self._validate_kl_in_reward()
        self._validate_env()
        self._validate_across()
        self._validate_async()
        self._validate_backend()
        self._validate_rewards()

    def _validate_env(self) -> None:
        """[rl.env]: its own keys, and the engines / loops multi-turn rollouts run in so far."""
        if self.env is None:
            return
        try:
            self.env.validate()
        except ValueError as e:
            raise type(e)(f"env.{e}") from None
        if self.rollout_backend != "vllm" and self.rollout.weights != "copy":  # vLLM: its own weights (docs/vllm.md)
            raise ValueError("rollout.weights: multi-turn rollouts ([rl.env]) decode with the engine's own weights copy; "
                             "set rollout.weights = 'copy'")
        if self.rollout_backend != "vllm" and self.rollout.kv_block_size:
            raise ValueError(f"rollout.kv_block_size: {self.rollout.kv_block_size} (the paged KV cache) is not used by "
                             "multi-turn rollouts ([rl.env]: a conversation keeps its slot across turns); set 0")
        if self.advantages.overlong_buffer:  # its ramp ends at rollout.max_new_tokens, one model turn's budget
            raise ValueError(f"advantages.overlong_buffer: {self.advantages.overlong_buffer} (DAPO's overlong shaping) "
                             "measures a response against rollout.max_new_tokens, the budget of one model turn; a "
                             "multi-turn trajectory's model tokens ([rl.env]) add up over its turns and would be "
                             "penalised with no turn near the limit; set 0 (a turn at max_new_tokens ends its "
                             "trajectory as 'length': rl.update.mask_truncated applies)")
        taken = [i for i, r in enumerate(self.rewards) if r.label() == "env"]
        if taken:  # the round's per-reward "env" is the environment's turn rewards (reward/env)
            raise ValueError(f"rewards[{taken[0]}].name: 'env' is the label of the [rl.env] environment's turn rewards "
                             "(reward/env); give this verifier another name")
        # what the multi-turn engine and trajectory samples do not carry yet: refused, not silently dropped
        if self.advantage == "gae":
            raise ConfigError("advantage: 'gae' (PPO's critic) is not wired to multi-turn trajectories ([rl.env]) yet; "
                              "use a group estimator (e.g. 'grpo') or remove [rl.env]")
        model_kinds = sorted({r.type for r in self.rewards if isinstance(r, (ModelRewardConfig, JudgeRewardConfig))})
        if model_kinds:
            raise ConfigError(f"rewards: type {model_kinds[0]!r} (a reward model / judge) is not scored on multi-turn "
                              "trajectories ([rl.env]) yet; use rule rewards or the environment's rewards")

    def _validate_selection(self) -> None:
        """The flat selection keys: registered names (rl/algorithms) and the backends this build has."""
        from megatron_vlm.rl.algorithms.advantage_estimators import ADVANTAGE_ESTIMATORS, resolve_normalize_std
        from megatron_vlm.rl.algorithms.policy_losses import POLICY_LOSSES

        for name, registry in (("policy_loss", POLICY_LOSSES), ("advantage", ADVANTAGE_ESTIMATORS)):
            if getattr(self, name) not in registry:
                raise ValueError(f"{name}: must be one of {registry.names()}, got {getattr(self, name)!r}")
        if self.advantages.normalize_std:
            try:
                resolve_normalize_std(self.advantage, self.advantages.normalize_std)
            except ValueError:
                raise ValueError(f"advantages.normalize_std: advantage = {self.advantage!r} is defined without the std "
                                 "division; leave advantages.normalize_std unset (or false), or use advantage = 'grpo'") from None
        if self.rollout_backend not in ROLLOUT_BACKENDS:
            raise ValueError(f"rollout_backend: must be one of {list(ROLLOUT_BACKENDS)}, got {self.rollout_backend!r}")
        if self.routing_replay not in ("off", "rollout"):
            raise ValueError(f"routing_replay: must be 'off' or 'rollout', got {self.routing_replay!r}")
        if self.routing_replay == "rollout" and self.rollout_backend == "vllm":
            raise ConfigError("routing_replay: 'rollout' needs the experts the rollout routed each token to, which the "
                              "vllm back end does not return here (vLLM 0.32 returns them only from its Triton model "
                              "runner V2, absent from its CPU build: not wired); use rollout_backend = 'builtin' or "
                              "routing_replay = 'off'")
        for key, t in (("rollout.temperature", self.rollout.temperature), ("eval.temperature", self.eval.temperature)):
            if self.rollout_backend == "vllm" and 0 < t < VLLM_MIN_TEMPERATURE:
                # vLLM raises it to 0.01 with a log warning (SamplingParams.__post_init__): its samples and log-probs
                # would be of another distribution than the one the update scores
                raise ConfigError(f"{key}: {t} is below {VLLM_MIN_TEMPERATURE}, which vLLM raises it to (its smallest "
                                  f"sampling temperature) with rollout_backend = 'vllm'; set it to >= {VLLM_MIN_TEMPERATURE}"
                                  + (" or 0 (greedy)" if key == "eval.temperature" else ""))
        truncated = [k for k, on in (("top_p", self.rollout.top_p < 1), ("top_k", self.rollout.top_k > 0)) if on]
        # vLLM reports log-probs of the truncated distribution it drew from (processed_logprobs); the training forward
        # and the built-in engine use the whole one. The loss terms that divide by the rollout's log-probs even with
        # recompute_logprobs would give each token a weight carrying the kept mass (1 / its share); as old log-probs
        # they would bias every ratio
        behaviour_terms = [what for what, on in (
            (f"loss.rollout_correction = {self.loss.rollout_correction!r} (pi_old / pi_rollout)",
             self.loss.rollout_correction != "none"),
            ("the decoupled loss of asynchronous.max_head_offpolicyness > 0 (pi_prox / pi_behav)",
             self.allocation is not None and self.asynchronous.max_head_offpolicyness > 0)) if on]
        if self.rollout_backend == "vllm" and truncated and behaviour_terms:
            raise ConfigError(f"rollout.{truncated[0]}: with rollout_backend = 'vllm', vLLM's log-probs are of the "
                              f"{truncated[0]}-truncated distribution (higher than the whole one's by -log of the kept "
                              f"mass), and {behaviour_terms[0]} weighs every token by them, unlike the built-in "
                              f"engine's; leave rollout.{truncated[0]} at its default or use rollout_backend = 'builtin'")
        if self.rollout_backend == "vllm" and truncated and not self.recompute_logprobs:
            raise ConfigError(f"rollout.{truncated[0]}: with rollout_backend = 'vllm', vLLM's log-probs are of the "
                              f"{truncated[0]}-truncated distribution, not of the policy the update scores; set "
                              "recompute_logprobs = true (old log-probs from the training forward) or leave "
                              f"rollout.{truncated[0]} at its default")

    def _validate_groups(self) -> None:
        """`batch.group_size = 1`: only for an estimator whose baseline is not the prompt's group (the registry's
        `needs_groups`: "gae"); what works on groups of two or more is refused with it (exit 2)."""
        from megatron_vlm.rl.algorithms.advantage_estimators import ADVANTAGE_ESTIMATORS, min_group_size

        G = self.batch.group_size
        if G >= 2:
            return
        if min_group_size(self.advantage) > G:
            free = [n for n in ADVANTAGE_ESTIMATORS if not ADVANTAGE_ESTIMATORS.get(n).needs_groups]
            # a group of one has advantage 0 always: nothing would be learned
            raise ValueError(f"batch.group_size: {G} completion per prompt with advantage = {self.advantage!r}, whose "
                             "advantages are relative within each prompt's group (a group of one has advantage 0 "
                             "always, nothing would be learned); set batch.group_size >= 2, or use an estimator with "
                             f"another baseline: {', '.join(repr(n) for n in free)} (the critic's values, [rl.critic]; "
                             "the batch mean)")
        adv = self.advantages
        for key, on, what in (("drop_equal_reward_groups", adv.drop_equal_reward_groups, "would drop every sample"),
                              ("dynamic_sampling", adv.dynamic_sampling, "would drop every group and sample again "
                               "until advantages.max_sampling_rounds ran out")):
            if on:
                raise ValueError(f"advantages.{key}: with batch.group_size = {G} every group of one completion has "
                                 f"equal rewards, so it {what}; set batch.group_size >= 2 or remove it")

    def _validate_critic(self) -> None:
        """`advantage = "gae"` (PPO with a critic): the `[rl.critic]` table and `advantages.lam` are read only then
        (`advantages.gamma` with "reinforce_plus_plus" too); what the critic does not run with yet is refused (exit 2)."""
        from megatron_vlm.rl.algorithms.advantage_estimators import (
            batch_normalised,
            needs_critic,
            reads_gamma,
        )

        if not needs_critic(self.advantage):
            if self.critic != RLCriticConfig():
                raise ValueError(f"critic: the [rl.critic] table is only read with advantage = 'gae' (PPO with a critic), "
                                 f"not {self.advantage!r}; remove it or set advantage = 'gae'")
            if not reads_gamma(self.advantage) and self.advantages.gamma is not None:
                raise ValueError(f"advantages.gamma: the discount of per-token rewards, only read with advantage = "
                                 f"'gae' or 'reinforce_plus_plus', not {self.advantage!r}; remove it")
            if self.advantages.lam is not None:
                raise ValueError(f"advantages.lam: GAE's lam, only read with advantage = 'gae', not "
                                 f"{self.advantage!r}; remove it")
            if self.policy_loss == "gspo" and batch_normalised(self.advantage):
                self._validate_gspo_returns()
            return
        if self.allocation is not None:
            raise ConfigError(f"advantage: {self.advantage!r} (PPO with a critic) is not supported with allocation "
                              "(asynchronous GRPO) yet: the critic lives on the synchronous loop's training ranks; "
                              "remove allocation or use a group estimator ('grpo', 'dr_grpo', 'rloo')")
        if self.policy_loss == "gspo":
            raise ValueError(f"policy_loss: 'gspo' takes one advantage per sequence; advantage = {self.advantage!r} gives "
                             "one per token (use 'clip', 'gspo_token' or 'cispo')")

    def _validate_gspo_returns(self) -> None:
        """`policy_loss = "gspo"` with a batch estimator (REINFORCE++): GSPO clips one ratio per sequence and weighs
        it by one advantage per sequence. The estimator's advantage of token t is its return, whitened over the step:
        without a discount (`advantages.gamma` unset or 1) and without the KL penalty in the per-token rewards
        (`loss.kl_coef = 0`, or `advantages.kl_in_reward = false`), the return is the completion's score on every
        token, so the advantage is one per sequence and GSPO is defined. A discount, or -kl_coef x KL_t in every
        token's reward, makes it vary along the sequence: refused here (gspo's loss would raise at the first update,
        after the step's rollout), naming the key that makes it vary."""
        from megatron_vlm.rl.algorithms.advantage_estimators import kl_in_reward, reads_gamma

        gamma = self.advantages.gamma
        if reads_gamma(self.advantage) and gamma is not None and gamma < 1.0:
            raise ValueError(f"policy_loss: 'gspo' takes one advantage per sequence; advantage = {self.advantage!r} with "
                             f"advantages.gamma = {gamma} (a discount) gives each token its own return; remove "
                             "advantages.gamma (or set 1.0), or use policy_loss 'clip', 'gspo_token' or 'cispo'")
        if self.loss.kl_coef > 0 and kl_in_reward(self.advantage, self.advantages.kl_in_reward):
            setting = "true" if self.advantages.kl_in_reward else f"unset, {self.advantage!r}'s default: true"
            raise ValueError(f"policy_loss: 'gspo' takes one advantage per sequence; advantage = {self.advantage!r} with "
                             f"advantages.kl_in_reward = {setting} puts -loss.kl_coef x KL_t (loss.kl_coef = "
                             f"{self.loss.kl_coef}) in every token's reward, so each token has its own return; set "
                             "advantages.kl_in_reward = false (the KL a loss term) or loss.kl_coef = 0, or use policy_loss "
                             "'clip', 'gspo_token' or 'cispo'")

    def _validate_kl_in_reward(self) -> None:
        """`advantages.kl_in_reward`: a setting the estimator can honour, and a KL to place (`loss.kl_coef > 0`)."""
        from megatron_vlm.rl.algorithms.advantage_estimators import kl_in_reward_choices

        setting = self.advantages.kl_in_reward
        if setting is None:
            return
        value = "true" if setting else "false"
        if self.loss.kl_coef == 0:
            raise ValueError(f"advantages.kl_in_reward: {value} has no effect when loss.kl_coef = 0 (no KL penalty, no "
                             "reference model); set loss.kl_coef > 0 or remove it")
        if setting in kl_in_reward_choices(self.advantage):
            return
        if setting:
            raise ValueError(f"advantages.kl_in_reward: true needs per-token rewards; advantage = {self.advantage!r} has "
                             "one advantage per completion (the KL stays in the loss); use advantage = "
                             "'reinforce_plus_plus_baseline' (a group baseline) or 'reinforce_plus_plus', or remove it")
        raise ValueError(f"advantages.kl_in_reward: false is not supported with advantage = {self.advantage!r}: the "
                         "critic learns the per-token rewards with the KL penalty in them; remove it")

    def _validate_across(self) -> None:
        """Checks that read more than one table."""
        ro, lo, adv = self.rollout, self.loss, self.advantages
        if ro.cuda_graphs == "on" and ro.weights == "shared" and self.allocation is None:
            raise ValueError("rollout.cuda_graphs: 'on' needs rollout.weights = 'copy' or 'expert_parallel' (the engine's "
                             "own weights; 'shared' runs lock-step forwards through the FSDP root)")
        if self.update.ref_offload and lo.kl_coef == 0:
            raise ValueError("update.ref_offload: has no effect when loss.kl_coef = 0 (no reference model is built)")
        if lo.kl_estimator != RLLossConfig().kl_estimator and lo.kl_coef == 0:
            raise ValueError(f"loss.kl_estimator: {lo.kl_estimator!r} has no effect when loss.kl_coef = 0 (no reference "
                             "model is built, no KL is computed); set loss.kl_coef > 0 or remove it")
        if adv.overlong_buffer >= ro.max_new_tokens:
            raise ValueError(f"advantages.overlong_buffer: must be smaller than rollout.max_new_tokens ({ro.max_new_tokens}), "
                             f"got {adv.overlong_buffer}")
        if lo.rollout_correction != "none" and not self.recompute_logprobs:
            raise ValueError(f"loss.rollout_correction: {lo.rollout_correction!r} compares the training-side old "
                             "log-probs with the rollout's; set recompute_logprobs = true")

    def _validate_async(self) -> None:
        """`allocation`, `asynchronous.max_head_offpolicyness`, `loss.behav_imp_weight_cap` and what the
        asynchronous loop refuses."""
        k = self.asynchronous.max_head_offpolicyness
        if self.allocation is not None:
            parse_allocation(self.allocation)  # ValueError naming the grammar
        elif k > 0:
            raise ValueError(f"asynchronous.max_head_offpolicyness: {k} needs the asynchronous loop; "
                             "set allocation = 'rollout:N+train:M' (or leave it 0)")
        if self.loss.behav_imp_weight_cap is not None and k == 0:
            raise ValueError("loss.behav_imp_weight_cap: only read by the decoupled loss of asynchronous GRPO "
                             "(allocation set and asynchronous.max_head_offpolicyness > 0); leave it unset")
        if self.allocation is None:
            return
        n_rollout = parse_allocation(self.allocation).rollout
        if self.batch.prompts_per_step < n_rollout:  # rollout rank r takes prompts r, r + N, ... of a step
            raise ValueError(f"batch.prompts_per_step: {self.batch.prompts_per_step} prompts per step for {n_rollout} "
                             f"rollout ranks (allocation = {self.allocation!r}): the last ones would never get a prompt; "
                             f"set it to >= {n_rollout} or use fewer rollout ranks")
        if self.advantages.dynamic_sampling:
            raise ValueError("advantages.dynamic_sampling: not supported with allocation (asynchronous GRPO streams a "
                             "fixed number of prompts per step); use advantages.drop_equal_reward_groups or the "
                             "synchronous loop")
        if k > 0 and self.loss.rollout_correction != "none":
            raise ValueError(f"loss.rollout_correction: {self.loss.rollout_correction!r} with "
                             "asynchronous.max_head_offpolicyness > 0: the decoupled loss already weights by "
                             "pi_prox / pi_behav; use loss.behav_imp_weight_cap instead")

    _BUILTIN_ENGINE_KEYS: ClassVar[tuple[str, ...]] = ("weights", "cuda_graphs", "kv_block_size", "kv_cache_blocks",
                                                       "batch_prompts", "memory_gib")
    """The [rl.rollout] keys only the built-in engine reads (refused with rollout_backend = "vllm")."""

    def _validate_backend(self) -> None:
        """The keys that depend on `rollout_backend`: `allocation`'s engine prefix, the built-in engine's own
        [rl.rollout] keys and the [rl.vllm] table."""
        if self.allocation is not None:
            engine = parse_allocation(self.allocation).engine
            if engine is not None and engine != "vllm":
                raise ValueError(f"allocation: {self.allocation!r}: the {engine!r} back end is not supported; the rollout "
                                 "ranks run the built-in engine or vLLM (rollout_backend = 'vllm' with 'vllm:dN+dM')")
            if engine == "vllm" and self.rollout_backend != "vllm":
                raise ValueError(f"allocation: {self.allocation!r} puts the rollout ranks on vLLM but rollout_backend = "
                                 f"{self.rollout_backend!r}; set rollout_backend = 'vllm' or write 'rollout:N+train:M'")
        if self.rollout_backend != "vllm":
            if self.vllm != VLLMConfig():
                raise ValueError("vllm: the [rl.vllm] table is only read with rollout_backend = 'vllm'")
            return
        if self.allocation is not None and self.vllm.sleep_mode:
            raise ValueError(f"vllm.sleep_mode: the engines of the asynchronous rollout ranks (allocation = "
                             f"{self.allocation!r}) generate all the time beside no trainer, so nothing puts them to "
                             "sleep; set it to false (size them with vllm.gpu_memory_utilization)")
        defaults = RLRolloutConfig()
        for key in self._BUILTIN_ENGINE_KEYS:
            if getattr(self.rollout, key) != getattr(defaults, key):
                where = ("vLLM's CUDA graphs are rl.vllm.enforce_eager (false: captured)" if key == "cuda_graphs" else
                         "size the engine in [rl.vllm] (max_num_seqs, cpu_kv_cache_gib / gpu_memory_utilization)")
                raise ValueError(f"rollout.{key}: a setting of the built-in engine; with rollout_backend = 'vllm' {where}")

    _VERIFIER_ONLY_POOL_KEYS: ClassVar[tuple[str, ...]] = ("timeout_s", "batch_timeout_s", "abs_max")
    """The [rl.reward_pool] keys only verifier calls read (workers and memory_limit_mb size the [rl.env] workers too,
    and max_failed_steps also counts the environment episodes)."""

    def _validate_rewards(self) -> None:
        if isinstance(self.rewards, _DefaultRewards) and self.env is not None:
            self.rewards = []  # no table with [rl.env]: the environment's turn rewards are the reward
        if not self.rewards and self.env is None:
            raise ValueError("rewards: at least one [[rl.rewards]] table is required (or an [rl.env] environment whose "
                             "turn rewards are the reward)")
        if not self.rewards:  # the environment's rewards alone: no verifier call for these limits to act on
            defaults = RLRewardPoolConfig()
            for key in self._VERIFIER_ONLY_POOL_KEYS:
                if getattr(self.reward_pool, key) != getattr(defaults, key):
                    raise ValueError(f"reward_pool.{key}: a limit of the verifier calls, and there is no [[rl.rewards]] "
                                     "verifier (the [rl.env] environment's rewards are the whole reward, not clipped "
                                     "or timed by it); remove it")
        labels = [r.label() for r in self.rewards]
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise ValueError(f"rewards: duplicate reward labels {dup}; give each a distinct `name`")
        for i, r in enumerate(self.rewards):
            try:
                r.validate()
            except ValueError as e:
                raise ValueError(f"rewards[{i}].{e}") from None
        for i, r in enumerate(self.rewards):
            if r.type in ("model", "judge") and self.allocation is not None:
                raise ValueError(f"rewards[{i}].type: {r.type!r} scores on the training ranks of the synchronous loop; "
                                 "asynchronous GRPO (allocation) scores on its rollout ranks, which do not load reward "
                                 "models yet: leave allocation unset or use a rule reward")
        known = [*labels, "env"] if self.env is not None else labels  # "env": the environment's return
        if self.accuracy_reward is not None and self.accuracy_reward not in known:
            raise ValueError(f"accuracy_reward: {self.accuracy_reward!r} is not one of the reward labels {known}")

    def critic_layout_refusal(self, parallel: Any) -> Optional[str]:
        """Why the `[parallel]` layout cannot hold PPO's critic (the message starts with the key; None when it can,
        or when `advantage` needs no critic): the critic is a plain module replicated on every data-parallel rank.
        Checked when the config loads (megatron_vlm/config/__init__.py), so such a run stops before any rank loads
        the policy; the critic's builder asks again (rl/critic/build.py `critic_refusal`)."""
        from megatron_vlm.rl.algorithms.advantage_estimators import needs_critic

        if not needs_critic(self.advantage):
            return None
        for key in ("tp", "cp", "pp", "ep"):
            if getattr(parallel, key, 1) > 1:
                return (f"parallel.{key}: {getattr(parallel, key)} with advantage = {self.advantage!r}: PPO's critic "
                        f"runs replicated on every data-parallel rank only so far; set parallel.{key} = 1 or use a "
                        "group estimator ('grpo', 'dr_grpo', 'rloo')")
        if getattr(parallel, "backend", "native") == "mcore":
            return (f"parallel.backend: 'mcore' with advantage = {self.advantage!r}: PPO's critic runs on the native "
                    "layers only so far; set parallel.backend = 'native'")
        return None

    def data_shards_refusal(self, dp_size: int) -> Optional[str]:
        """Why synchronous GRPO cannot deal `batch.prompts_per_step` prompts over `dp_size` data-parallel ranks (the
        message starts with the key; None when it can, or for the asynchronous loop, which checks its own training
        ranks in config/mode_keys.py): each rank generates and trains on prompts r, r + dp, ... of a step (a dynamic
        sampling round has as many), so with fewer prompts than ranks the last ones would run a dummy round (loss x 0)
        at every step, their compute wasted without a word. Asked where the size is known: the job once its mesh is
        built (jobs.run_grpo), `--check` with its planned layout."""
        if self.allocation is not None or dp_size <= 1 or self.batch.prompts_per_step >= dp_size:
            return None
        return (f"rl.batch.prompts_per_step: {self.batch.prompts_per_step} prompts per step for {dp_size} data-parallel "
                f"ranks: ranks {self.batch.prompts_per_step}..{dp_size - 1} would get no prompt and train on a dummy "
                f"(loss x 0) at every step; set it to >= {dp_size} (a multiple of {dp_size} shares the work evenly) or "
                "run fewer data-parallel ranks (more parallel.tp / parallel.cp, or fewer processes)")

    def critic_warmup_refusal(self, total_steps: Optional[int]) -> Optional[str]:
        """Why `[rl.critic] warmup_steps` cannot serve a run of `total_steps` steps (None when it can, or when the
        length is not known yet): critic-only steps for the whole run would leave the policy, and its export, as
        it started, without a word."""
        from megatron_vlm.rl.algorithms.advantage_estimators import needs_critic

        warmup = self.critic.warmup_steps
        if total_steps is None or not needs_critic(self.advantage) or warmup < total_steps:
            return None
        return (f"rl.critic.warmup_steps: {warmup} critic-only steps in a run of {total_steps} steps: the policy would "
                "never be updated; set it below the run's length (train.max_steps, or the steps of train.epochs)")

    def adv_normalize_std(self) -> bool:
        """Whether advantages are divided by the group std (advantages.normalize_std resolved for `advantage`)."""
        from megatron_vlm.rl.algorithms.advantage_estimators import resolve_normalize_std

        return resolve_normalize_std(self.advantage, self.advantages.normalize_std)  # gae, REINFORCE++: over tokens

    def accuracy_label(self) -> str:
        """Label of the reward that counts as accuracy."""
        return self.accuracy_reward or (self.rewards[0].label() if self.rewards else "env")

    def render_prompt(self, problem: str) -> str:
        """The user turn for one dataset question."""
        return self.prompts.template.format(problem=problem)
