"""The `[rl]` config section: GRPO sampling, optimisation, loss, rewards and evaluation settings.

The strict loader (megatron_vlm.config) builds `RLConfig` from the `[rl]` TOML table; nested
tables are `[rl.eval]` and `[[rl.rewards]]` (one per verifier, `type =` picks it, see
rl/rewards/config.py). `validate()` holds the cross-field checks and raises ValueError naming the
field. Names follow the GRPO / PPO literature and the public recipes (AReaL, verl): a step takes
`prompts_per_step` prompts, samples `group_size` completions for each, and runs `ppo_epochs`
passes of `mini_batches_per_step` optimizer steps over them.

This module must stay free of torch imports: reward worker processes import the rewards package.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from megatron_vlm.rl.async_allocation import parse_allocation
from megatron_vlm.rl.rewards.config import (
    ChoiceRewardConfig,
    CustomRewardConfig,
    ExactMatchRewardConfig,
    FormatRewardConfig,
    MathRewardConfig,
)
from megatron_vlm.rl.rollout.vllm_config import VLLMConfig, check_backend  # [rl.vllm] (hook: rollout_backend)

__all__ = ["RLConfig", "RLEvalConfig"]

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
    """Nucleus sampling threshold for evaluation."""
    max_new_tokens: Optional[int] = None
    """Generation budget for evaluation (unset = rl.max_new_tokens)."""
    max_prompts: int = 0
    """Evaluate on at most this many held-out prompts (0 = all)."""
    correct_threshold: float = 1.0
    """A sample counts as correct when its accuracy reward is >= this (rewards are in [0, 1])."""

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
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if self.max_prompts < 0:
            raise ValueError(f"max_prompts: must be >= 0, got {self.max_prompts}")


@dataclass(kw_only=True)
class RLConfig:
    # --- sampling -------------------------------------------------------------------------------
    group_size: int = 8
    """Completions sampled per prompt (G); advantages are relative within each group."""
    temperature: float = 1.0
    """Sampling temperature of rollouts; the training log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1 = off)."""
    top_k: int = 0
    """Keep only the k most likely tokens when sampling (0 = off)."""
    max_new_tokens: int = 1024
    """Generation budget per completion; longer completions are cut (and count as truncated)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: generation of a completion ends after the first of these (EOS always stops)."""
    rollout_batch_prompts: int = 0
    """Prompts generated together on one rank (their KV cache holds rollout_batch_prompts * group_size
    sequences); 0 = all of the rank's prompts of a step at once."""
    rollout_weights: str = "shared"
    """Weights the rollout engine generates with. "shared": the trainer's parameters, called through the
    FSDP root (no extra memory, but the parameters are all-gathered at every decoding step and ranks
    decode in lock-step batches of rollout_batch_prompts). "copy": an unsharded inference copy of the
    policy on every rank, refreshed once per step from the trainer (one gather of the full weights per
    step, one more model in memory), decoding with continuous batching (rollout_batch_prompts *
    group_size slots, refilled as completions end) and no collective per token. On one device nothing
    is gathered, so "shared" is the cheaper choice there."""
    rollout_cuda_graphs: str = "off"
    """Decode steps of the rollout engine on static buffers per batch-size bucket (1, 2, 4, ... slots),
    captured once per bucket as CUDA graphs and replayed (one launch per step instead of hundreds of small
    kernels; rl/rollout/decode_graphs.py). "auto": on for a CUDA device, off elsewhere and where it cannot
    work (logged): rollout_weights = "shared" (lock-step FSDP forwards), MoE layers (routing sizes its
    GEMMs on the host), a failed capture. "on": as "auto", but those cases are errors, and on a CPU the
    same static step runs eagerly (for tests: its first runs are checked for host reads). "off": eager
    steps. Needs rollout_weights = "copy" (or asynchronous GRPO, whose rollout ranks hold their own copy,
    written in place by the weight pushes, which a graph then reads)."""
    kv_block_size: int = 0
    """Positions per block of the rollout engine's paged KV cache (0 = the slot cache: every sequence holds
    a slot of the batch's longest prompt + the budget). >= 2: the keys / values live in a pool of blocks
    addressed by a block table (`PagedSlotCache`, models/common/slot_cache.py); an admitted sample takes
    ceil((prompt + budget) / kv_block_size) blocks and returns them when it finishes. Same tokens and
    log-probs as the slot cache (float rounding aside); on the CPU ~5-9 % slower. Attention-only decoders:
    refused for the Mamba2 hybrid (Nemotron-VL, its recurrent state is per slot) and with
    rollout_cuda_graphs = "on" (static decode steps need the slot layout; "auto" decodes eagerly, logged).
    Read by every engine of the job: synchronous and asynchronous GRPO rollouts and [rl.eval]."""
    kv_cache_blocks: int = 0
    """Blocks in the paged KV cache's pool (with kv_block_size >= 2; 0 = derived: 1 + slots x
    ceil((longest prompt + budget) / kv_block_size), room for every slot at full length, so memory is the
    slot cache's). Set: the pool fixes the rollout's KV memory whatever the slot count
    (rollout_batch_prompts x group_size) and a waiting sample is admitted when the blocks of its prompt +
    budget are free (with a pool smaller than the slots' full length fewer run at once, and sampled tokens
    differ from the slot cache's, since a sample's random numbers follow its slot and step; --check plans
    the pool's memory). Needs rollout_weights = "copy" (continuous batching: "shared" lock-step batches
    start every sample at once) and room for one sample: >= 1 + ceil(data.max_tokens_per_pack /
    kv_block_size) (one block is the engine's scratch row)."""
    prompt_sharing: str = "auto"
    """Training forwards (policy update, old and reference log-probs) with each prompt packed once for
    the completions of its group instead of once per completion: the same log-probs and gradients up to
    float rounding, with the prompt's projections, MLPs and images computed once (G times less prompt
    work). "auto": where the decoder supports it (attention-only decoders, not Nemotron-VL's Mamba2
    hybrid) and tensor / context parallelism are off (the startup log says which); "off": every
    completion packed with its own copy of the prompt."""

    # --- batch and optimisation -----------------------------------------------------------------
    prompts_per_step: int = 32
    """Prompts per GRPO step over all data-parallel ranks; a step has prompts_per_step * group_size samples."""
    ppo_epochs: int = 1
    """Passes over each step's samples."""
    mini_batches_per_step: int = 1
    """Optimizer steps per PPO epoch: the step's samples are split into this many mini-batches
    (1 = fully on-policy update)."""

    # --- loss -------------------------------------------------------------------------------------
    clip_ratio_low: float = 0.2
    """PPO clip range below 1: the ratio is clipped to at least 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """PPO clip range above 1: the ratio is clipped to at most 1 + clip_ratio_high (DAPO's
    "clip-higher" uses e.g. 0.28)."""
    kl_coef: float = 0.0
    """Coefficient of the KL penalty against the frozen reference model; 0 drops the reference model."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """KL estimator per token: k1 = log pi - log pi_ref; k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1
    (non-negative, unbiased)."""
    ref_offload: bool = False
    """Keep the reference model's weights on CPU and move them to the device only to score a batch."""
    policy_loss: Literal["clip", "gspo", "gspo_token", "cispo"] = "clip"
    """Policy-gradient loss (megatron_vlm/rl/losses.py): "clip" = PPO / GRPO clipped token ratio;
    "gspo" = GSPO (Zheng et al. 2025): the sequence ratio exp(mean_t (log pi - log pi_old)), clipped
    per sequence — its paper uses tiny clip ranges, clip_ratio_low = 3e-4, clip_ratio_high = 4e-4,
    and loss_agg = "seq-mean"; "gspo_token" = GSPO-token (the sequence ratio with per-token
    advantages); "cispo" = CISPO (MiniMax-M1 2025): clipped, detached importance weight x advantage x
    log pi, every token keeps its gradient. clip_ratio_low / clip_ratio_high are the ranges of all four."""
    loss_agg: Literal["token-mean", "seq-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """Loss aggregation: token-mean averages over all response tokens of the mini-batch; seq-mean
    averages each sequence's tokens first, then over sequences; seq-mean-token-sum-norm sums over all
    tokens and divides by the constant max_new_tokens x sequences (Dr. GRPO, Liu et al. 2025)."""
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    """Advantage estimator (megatron_vlm/rl/advantages.py): "grpo" = group mean-centred reward divided by
    the group std (normalize_adv_std); "dr_grpo" = mean-centred, no std division (Dr. GRPO, Liu et al.
    2025; pair it with loss_agg = "seq-mean-token-sum-norm"); "rloo" = reward minus the mean of the
    other G - 1 rewards of the group (Ahmadian et al. 2024)."""
    normalize_adv_std: Optional[bool] = None
    """Divide group-relative advantages by the group's reward standard deviation. Unset = the
    estimator's definition (grpo: true; dr_grpo, rloo: false); false with grpo keeps mean-centred
    rewards only; true with dr_grpo or rloo is refused."""
    drop_equal_reward_groups: bool = False
    """Drop groups whose G rewards are all equal (they carry no learning signal) without sampling more
    (dynamic_sampling refills the step)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025): groups whose rewards are all equal are dropped and more
    prompts are generated (prompts_per_step per round, drawn from the training set) until the step has
    prompts_per_step groups with non-zero reward variance or max_sampling_rounds rounds ran; surplus
    groups of the last round are dropped. Rounds and dropped groups are logged (sampling/*)."""
    max_sampling_rounds: int = 3
    """Dynamic sampling: at most this many generation rounds per step (the first included); a step
    that still has fewer informative groups trains on those it has (sampling/kept_groups says so)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: the last overlong_buffer tokens of the max_new_tokens budget,
    over which the penalty rises linearly from 0 to overlong_penalty (0 = off)."""
    overlong_penalty: float = 0.0
    """Reward subtracted at max_new_tokens (DAPO uses 1.0); needs overlong_buffer >= 1."""
    mask_truncated: bool = False
    """Exclude completions cut at max_new_tokens from the loss (DAPO's overlong filtering); they still
    count in their group's advantages."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss subtracts entropy_coef x the policy entropy aggregated like the loss."""
    skip_zero_advantage: bool = True
    """Leave completions whose advantage is exactly 0 (every completion of a group whose rewards are all
    equal, under grpo's std normalisation or not) out of the update's forwards and backwards, and out of
    the old-log-prob forward (recompute_logprobs; except with rollout_correction = "mis", whose drops
    read every sample's old log-probs). Their loss
    and gradient are exactly 0, and the normaliser (tokens / sequences of the mini-batch) still counts
    them, so the update is the same up to float rounding (packs hold other samples; with LoRA dropout, other
    random masks) for a fraction of
    the compute: late in training most groups are often solved or hopeless. Applied only where it is
    exact: no KL term (kl_coef = 0), no entropy bonus, no MoE layers (their auxiliary loss and load
    statistics see every token); a mini-batch with nothing left still runs one zero-gradient forward, so
    the optimizer steps as it would have. The actor/* metrics (entropy, clip fractions) then cover the
    trained completions only; false: every completion is forwarded (unlike drop_equal_reward_groups,
    neither setting changes the normaliser)."""
    rollout_correction: Literal["none", "tis", "mis"] = "none"
    """Rollout / training mismatch correction (rollout numerics differ from training's; Yao et al. 2025,
    "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"): "tis" multiplies each
    token's loss by min(pi_train_old / pi_rollout, C); "mis" drops sequences whose geometric-mean ratio
    lies outside [1/C, C]. Needs recompute_logprobs = true (the training-side old log-probs). The
    mismatch KL and ratio min / mean / max are logged whenever recompute_logprobs is on."""
    rollout_correction_cap: float = 2.0
    """C of rollout_correction (> 1)."""
    max_head_offpolicyness: int = 0
    """Asynchronous GRPO (`allocation` set): how many policy versions the oldest token of a trained
    sample may lag the trainer (version = GRPO steps done). A rollout rank does not start the prompts
    of step b before it holds version b - max_head_offpolicyness, so every token of a sample trained at
    step s was drawn by a version >= s - max_head_offpolicyness. 0 = synchronous: the same results as
    the synchronous loop; > 0 trains with the decoupled PPO loss (proximal = the trainer's log-probs
    before the update, behaviour = the rollout's, weight capped by behav_imp_weight_cap)."""
    recompute_logprobs: bool = False
    """Recompute the old-policy log-probs of the PPO ratio with a training-layout forward pass before
    the update, instead of taking the rollout engine's behaviour log-probs (one extra forward over the
    step's samples; worth it when rollout numerics differ from training's, e.g. bf16 KV-cache decoding
    against fp32 training, or an external engine)."""
    behav_imp_weight_cap: Optional[float] = None
    """Asynchronous GRPO with max_head_offpolicyness > 0 (decoupled PPO loss): tokens whose importance
    weight pi_prox / pi_behav exceeds this cap get weight 0 (kept in the normaliser, counted as
    actor/behav_capped_frac); unset = no cap."""
    allocation: Optional[str] = None
    """Asynchronous GRPO: split the job's processes into rollout and training ranks,
    "rollout:N+train:M" (N + M = number of processes; the AReaL spelling "vllm:dN+dM" means the
    same). Rollout ranks generate continuously with their own copy of the policy and score the
    completions; training ranks (the first M global ranks) train on completed groups and push the
    new weights after every step (megatron_vlm/rl/async_allocation.py, rl/README.md). Unset = the
    synchronous loop on every rank."""

    # --- rewards --------------------------------------------------------------------------------
    rewards: list[MathRewardConfig | ChoiceRewardConfig | FormatRewardConfig | ExactMatchRewardConfig | CustomRewardConfig] = field(
        default_factory=lambda: [MathRewardConfig()]
    )
    """Verifiers whose weighted sum is the reward, one `[[rl.rewards]]` table each (`type =` picks it)."""
    accuracy_reward: Optional[str] = None
    """Label of the reward reported as accuracy (and used by evaluation); unset = the first reward."""
    reward_timeout_s: float = 10.0
    """Time limit of one verifier call; a call that exceeds it (or raises) scores 0 and is counted."""
    reward_workers: int = 2
    """Worker processes that run verifier calls (per rank that scores rewards)."""

    # --- prompts ----------------------------------------------------------------------------------
    prompt_template: str = _DEFAULT_PROMPT_TEMPLATE
    """Template of the user turn; `{problem}` is replaced by the dataset's question text
    (literal braces are written `{{` `}}`)."""
    system_prompt: Optional[str] = None
    """Optional system turn of the chat."""

    model_path_hint: Optional[str] = None
    """Shown when model.path has no model yet: how to produce it (e.g. the SFT run a GRPO demo starts from)."""

    eval: RLEvalConfig = field(default_factory=RLEvalConfig)
    """Held-out evaluation ([rl.eval])."""

    # --- rollout back end (hook: rl/rollout/vllm_config.py) ------------------------------------------
    rollout_backend: str = "builtin"
    """Which engine generates the rollouts: "builtin" (the policy model itself, rl/rollout/policy_engine.py)
    or "vllm" (an in-process vLLM engine on every generating rank, fed the trainer's weights after every
    optimizer step: docs/vllm.md). vLLM's settings are in [rl.vllm]."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """The vLLM engine's settings ([rl.vllm]; read only with rollout_backend = "vllm")."""

    # --- reliability limits (appended) --------------------------------------------------------------
    reward_memory_limit_mb: int = 4096
    """Address-space cap (RLIMIT_AS) of each reward worker process, interpreter and sympy included;
    a verifier that exceeds it fails (scores 0, counted) instead of exhausting the node (0 = no cap)."""
    reward_batch_timeout_s: float = 300.0
    """Deadline of one batch of verifier calls (a step's or an evaluation's scoring on one rank), from
    its first call: calls still unfinished then score 0 and count as timeouts, so a step waits at most
    this long for rewards, not (number of calls) x reward_timeout_s."""
    reward_abs_max: float = 10.0
    """A verifier value beyond +-reward_abs_max is clipped to it and a non-finite one (NaN) becomes 0;
    both are counted (`reward/clipped`). Keeps one custom verifier's 1e30 or inf from swamping the
    advantages or overflowing the loss."""
    rollout_memory_gib: float = 0.0
    """KV-cache budget of one rollout batch per rank, in GiB, used when rollout_batch_prompts = 0:
    prompts per rollout batch = floor(budget / (group_size x data.max_tokens_per_pack cache slots x KV
    bytes per slot)), at least 1 (0 = no budget: all of the rank's prompts at once)."""

    def validate(self) -> None:
        def positive(name: str) -> None:
            v = getattr(self, name)
            if v < 1:
                raise ValueError(f"{name}: must be >= 1, got {v}")

        for name in ("group_size", "max_new_tokens", "prompts_per_step", "ppo_epochs", "mini_batches_per_step", "reward_workers"):
            positive(name)
        if self.prompt_sharing not in ("auto", "off"):
            raise ValueError(f"prompt_sharing: must be 'auto' or 'off', got {self.prompt_sharing!r}")
        if self.rollout_weights not in ("shared", "copy"):
            raise ValueError(f"rollout_weights: must be 'shared' or 'copy', got {self.rollout_weights!r}")
        if self.rollout_cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"rollout_cuda_graphs: must be 'auto', 'on' or 'off', got {self.rollout_cuda_graphs!r}")
        if self.rollout_cuda_graphs == "on" and self.rollout_weights != "copy" and self.allocation is None:
            raise ValueError("rollout_cuda_graphs: 'on' needs rollout_weights = 'copy' (the engine's own weights; "
                             "'shared' runs lock-step forwards through the FSDP root)")
        self._validate_paged_kv()
        if self.rollout_batch_prompts < 0:
            raise ValueError(f"rollout_batch_prompts: must be >= 0 (0 = all at once), got {self.rollout_batch_prompts}")
        if self.temperature <= 0:
            raise ValueError(f"temperature: must be > 0 for GRPO sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (0 = off), got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop: stop strings must not be empty")
        samples = self.prompts_per_step * self.group_size
        if self.mini_batches_per_step > samples:
            raise ValueError(
                f"mini_batches_per_step: {self.mini_batches_per_step} mini-batches from "
                f"{samples} samples per step (prompts_per_step * group_size) leaves some empty"
            )
        if not 0 <= self.clip_ratio_low < 1:
            raise ValueError(f"clip_ratio_low: must be in [0, 1), got {self.clip_ratio_low}")
        if self.clip_ratio_high < 0:
            raise ValueError(f"clip_ratio_high: must be >= 0, got {self.clip_ratio_high}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef: must be >= 0, got {self.kl_coef}")
        self._validate_algorithm()
        if self.ref_offload and self.kl_coef == 0:
            raise ValueError("ref_offload: has no effect when kl_coef = 0 (no reference model is built)")
        if self.group_size < 2:
            # a group of one has advantage 0 always: nothing would be learned
            raise ValueError(f"group_size: GRPO needs >= 2 samples per prompt for group-relative advantages, got {self.group_size}")
        if self.max_head_offpolicyness < 0:
            raise ValueError(f"max_head_offpolicyness: must be >= 0, got {self.max_head_offpolicyness}")
        if self.behav_imp_weight_cap is not None and self.behav_imp_weight_cap <= 1:
            raise ValueError(f"behav_imp_weight_cap: must be > 1, got {self.behav_imp_weight_cap}")
        self._validate_async()
        check_backend(self)  # hook: rollout_backend, [rl.vllm], allocation's engine prefix
        if not self.rewards:
            raise ValueError("rewards: at least one [[rl.rewards]] table is required")
        labels = [r.label() for r in self.rewards]
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise ValueError(f"rewards: duplicate reward labels {dup}; give each a distinct `name`")
        for i, r in enumerate(self.rewards):
            try:
                r.validate()
            except ValueError as e:
                raise ValueError(f"rewards[{i}].{e}") from None
        if self.accuracy_reward is not None and self.accuracy_reward not in labels:
            raise ValueError(f"accuracy_reward: {self.accuracy_reward!r} is not one of the reward labels {labels}")
        if self.reward_timeout_s <= 0:
            raise ValueError(f"reward_timeout_s: must be > 0, got {self.reward_timeout_s}")
        if self.reward_memory_limit_mb < 0 or 0 < self.reward_memory_limit_mb < 256:
            raise ValueError(f"reward_memory_limit_mb: 0 (no cap) or >= 256 (the interpreter and sympy need some), "
                             f"got {self.reward_memory_limit_mb}")
        if not self.reward_batch_timeout_s > 0 or self.reward_batch_timeout_s == float("inf"):
            raise ValueError(f"reward_batch_timeout_s: must be finite and > 0, got {self.reward_batch_timeout_s}")
        if not self.reward_abs_max > 0 or self.reward_abs_max == float("inf"):
            raise ValueError(f"reward_abs_max: must be finite and > 0, got {self.reward_abs_max}")
        if not self.rollout_memory_gib >= 0 or self.rollout_memory_gib == float("inf"):
            raise ValueError(f"rollout_memory_gib: must be finite and >= 0 (0 = no budget), got {self.rollout_memory_gib}")
        if "{problem}" not in self.prompt_template:
            raise ValueError("prompt_template: must contain the {problem} placeholder")
        try:
            self.prompt_template.format(problem="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"prompt_template: only {{problem}} may be a placeholder (write literal braces as {{{{ }}}}): {e!r}"
            ) from None
        try:
            self.eval.validate()
        except ValueError as e:
            raise ValueError(f"eval.{e}") from None

    def _validate_algorithm(self) -> None:
        """The policy-loss / advantage / sampling / shaping / correction keys and their combinations."""
        choices = {"policy_loss": ("clip", "gspo", "gspo_token", "cispo"),
                   "loss_agg": ("token-mean", "seq-mean", "seq-mean-token-sum-norm"),
                   "advantage": ("grpo", "dr_grpo", "rloo"), "rollout_correction": ("none", "tis", "mis")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: must be one of {list(allowed)}, got {getattr(self, name)!r}")
        if self.advantage != "grpo" and self.normalize_adv_std:
            raise ValueError(f"normalize_adv_std: advantage = {self.advantage!r} is defined without the std division; "
                             "leave normalize_adv_std unset (or false), or use advantage = 'grpo'")
        if self.max_sampling_rounds < 1:
            raise ValueError(f"max_sampling_rounds: must be >= 1, got {self.max_sampling_rounds}")
        if self.overlong_buffer < 0:
            raise ValueError(f"overlong_buffer: must be >= 0 (0 = off), got {self.overlong_buffer}")
        if self.overlong_penalty < 0:
            raise ValueError(f"overlong_penalty: must be >= 0, got {self.overlong_penalty}")
        if self.overlong_buffer >= self.max_new_tokens:
            raise ValueError(f"overlong_buffer: must be smaller than max_new_tokens ({self.max_new_tokens}), "
                             f"got {self.overlong_buffer}")
        if (self.overlong_buffer > 0) != (self.overlong_penalty > 0):
            raise ValueError(f"overlong_penalty: the soft overlong penalty needs both overlong_buffer >= 1 and "
                             f"overlong_penalty > 0 (one alone has no effect), got overlong_buffer = "
                             f"{self.overlong_buffer}, overlong_penalty = {self.overlong_penalty}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef: must be >= 0, got {self.entropy_coef}")
        if self.rollout_correction_cap <= 1:
            raise ValueError(f"rollout_correction_cap: must be > 1, got {self.rollout_correction_cap}")
        if self.rollout_correction != "none" and not self.recompute_logprobs:
            raise ValueError(f"rollout_correction: {self.rollout_correction!r} compares the training-side old "
                             "log-probs with the rollout's; set recompute_logprobs = true")

    def _validate_paged_kv(self) -> None:
        """`kv_block_size` / `kv_cache_blocks` and the rollout modes that cannot use the paged KV cache (the
        model-dependent refusal, Mamba2 hybrid decoders, is the engine's: rl/rollout/policy_engine.py)."""
        if self.kv_block_size < 0 or self.kv_block_size == 1:
            raise ValueError(f"kv_block_size: must be 0 (the slot cache) or >= 2 positions per block (one block "
                             f"also holds the engine's scratch row of 2 positions), got {self.kv_block_size}")
        if self.kv_block_size and self.rollout_cuda_graphs == "on":
            raise ValueError(f"kv_block_size: {self.kv_block_size} (the paged KV cache) cannot run with rollout_cuda_graphs "
                             "= 'on': static CUDA-graph decode steps need the slot layout (the block table changes as "
                             "samples come and go); set kv_block_size = 0 or rollout_cuda_graphs = 'auto' / 'off'")
        if self.kv_cache_blocks < 0:
            raise ValueError(f"kv_cache_blocks: must be >= 0 (0 = derived from the slots), got {self.kv_cache_blocks}")
        if self.kv_cache_blocks and not self.kv_block_size:
            raise ValueError(f"kv_cache_blocks: {self.kv_cache_blocks} sizes the paged KV cache, which is off "
                             "(kv_block_size = 0); set kv_block_size >= 2 too, or leave kv_cache_blocks 0")
        if self.kv_cache_blocks and self.rollout_weights != "copy":
            raise ValueError(f"kv_cache_blocks: {self.kv_cache_blocks} needs rollout_weights = 'copy' (continuous "
                             "batching); with 'shared' every sample of a lock-step batch starts at once, so the pool "
                             "must hold them all: leave kv_cache_blocks 0 (derived)")

    def _validate_async(self) -> None:
        """`allocation`, `max_head_offpolicyness`, `behav_imp_weight_cap` and what the asynchronous loop refuses."""
        if self.allocation is not None:
            parse_allocation(self.allocation)  # ValueError naming the grammar
        elif self.max_head_offpolicyness > 0:
            raise ValueError(f"max_head_offpolicyness: {self.max_head_offpolicyness} needs the asynchronous loop; "
                             "set allocation = 'rollout:N+train:M' (or leave it 0)")
        if self.behav_imp_weight_cap is not None and self.max_head_offpolicyness == 0:
            raise ValueError("behav_imp_weight_cap: only read by the decoupled loss of asynchronous GRPO "
                             "(allocation set and max_head_offpolicyness > 0); leave it unset")
        if self.allocation is None:
            return
        if self.dynamic_sampling:
            raise ValueError("dynamic_sampling: not supported with allocation (asynchronous GRPO streams a fixed "
                             "number of prompts per step); use drop_equal_reward_groups or the synchronous loop")
        if self.max_head_offpolicyness > 0 and self.rollout_correction != "none":
            raise ValueError(f"rollout_correction: {self.rollout_correction!r} with max_head_offpolicyness > 0: the "
                             "decoupled loss already weights by pi_prox / pi_behav; use behav_imp_weight_cap instead")

    def adv_normalize_std(self) -> bool:
        """Whether advantages are divided by the group std (normalize_adv_std resolved for `advantage`)."""
        return self.normalize_adv_std if self.normalize_adv_std is not None else self.advantage == "grpo"

    def accuracy_label(self) -> str:
        """Label of the reward that counts as accuracy."""
        return self.accuracy_reward or self.rewards[0].label()

    def render_prompt(self, problem: str) -> str:
        """The user turn for one dataset question."""
        return self.prompt_template.format(problem=problem)
