"""The training-side config sections: [model] [train] [optimizer] [scheduler] [parallel]
[checkpoint] [logging].

Each section is a kw_only dataclass; the string under each field is its documentation (the README's
config reference is generated from these). `validate()` holds cross-field checks and raises
ValueError("<key>: ...") — the loader prefixes the section name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional, Union

from megatron_vlm.table_checks import above, at_least


@dataclass(kw_only=True)
class ModelConfig:
    PATHS: ClassVar[tuple[str, ...]] = ("path",)  # filesystem paths: a leading ~ is expanded (config/loader.py)
    path: str
    """Hugging Face model folder (config.json, safetensors, tokenizer, preprocessor)."""
    synthesize: Optional[Literal["tiny_qwen2_5_vl", "tiny_qwen3_vl", "tiny_qwen3_vl_moe", "tiny_internvl", "tiny_nemotron_vl",
                                 "tiny_nemotron_qwen3_vision", "tiny_qwen2", "tiny_qwen3", "tiny_qwen3_moe"]] = None
    """If set and `path` does not exist, build this tiny random model + tokenizer + processor there
    (deterministic, offline; used by the demo and tests; tiny_qwen2 / tiny_qwen3 / tiny_qwen3_moe are
    text-only). A path holding another tiny model built this way is refused (exit 2); a model folder not
    built here is used as it is."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the master weights held by the optimizer (bf16 compute comes from [train] precision)."""

    def validate(self) -> None:
        if not self.path:
            raise ValueError("path: must not be empty")


@dataclass(kw_only=True)
class TrainConfig:
    PATHS: ClassVar[tuple[str, ...]] = ("output_dir",)  # filesystem paths: a leading ~ is expanded (config/loader.py)
    mode: Literal["sft", "grpo", "dpo", "reward", "eval"] = "sft"
    """Which job runs: supervised fine-tuning, GRPO reinforcement learning ([rl] section), preference
    optimisation on chosen / rejected pairs ([dpo] section; docs/dpo.md), reward-model training on the same
    pairs ([reward] section; docs/reward_models.md) or benchmark evaluation without training ([eval] section;
    `launch/evaluate.py`)."""
    output_dir: str = "runs/default"
    """Run folder: config.toml, checkpoints/, metrics CSVs, tensorboard/, exports."""
    seed: int = 0
    """Seeds every RNG (python, numpy, torch, data order); 0 to 2**32 - 1 (numpy's seed range)."""
    max_steps: Optional[int] = None
    """Optimizer steps to run; if unset, `epochs` decides (set one of the two, not both)."""
    epochs: Optional[float] = None
    """Passes over the training data, instead of max_steps (not both)."""
    micro_batches_per_step: int = 1
    """Gradient accumulation: packed micro-batches per data-parallel rank per optimizer step."""
    precision: Literal["auto", "bf16", "fp32", "fp8"] = "auto"
    """Compute dtype: auto = bf16 params / fp32 reduce on GPU/NPU (FSDP2 MixedPrecisionPolicy), fp32 on CPU.
    fp8 = bf16 training whose language-decoder linear layers run their matmuls in float8 (torchao, the `fp8`
    extra; SFT only; CUDA compute capability >= 8.9, emulated on the CPU); the vision tower and lm_head stay bf16."""
    fp8_recipe: Optional[Literal["tensorwise", "rowwise"]] = None
    """Float8 scaling with precision = "fp8" (unset = tensorwise): one scale per tensor, or one per row
    (rowwise: finer, slower). Only with precision = "fp8"."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm (computed across shards); 0 disables clipping."""
    train_layers: list[str] = field(default_factory=list)
    """Regexes over parameter or module-class names; when non-empty everything else is frozen
    (e.g. ["Qwen3VLVisionPatchMerger"] or ["^visual\\.merger\\."])."""
    activation_checkpointing: Union[bool, Literal["full", "selective"]] = False
    """Recompute in backward to save activation memory, per transformer block (the policy's, and PPO's critic's).
    true / "full": the whole block
    (only its input is kept); "selective": the outputs of its matmuls and attention are kept and only the cheap
    ops between them (norms, rotary, activations, casts) are recomputed: at the Qwen2.5-VL-3B shape about 60 % of
    the activation memory of no checkpointing, for little recompute; with `parallel.compile` the fastest step
    where it fits (benchmarks/RESULTS.md). Under FSDP2 mixed precision a Nemotron-H MoE / Mamba2 block, whose
    fp32 router is an FSDP2 unit of its own, is checkpointed per child and piece as with `parallel.compile` (the
    unit's hooks cannot run inside a selective checkpoint); --check counts the inputs those checkpoints keep."""
    eval_every: int = 0
    """Run validation (loss, perplexity, answer accuracy if the data has answers) every N steps; 0 = only at the end."""
    eval_max_batches: int = 0
    """Cap on validation micro-batches of the held-out loss per evaluation (0 = the whole eval split); the
    answer-accuracy pass (`eval_generate`) still decodes every eval prompt."""
    eval_generate: bool = True
    """At evaluation also greedy-decode the eval prompts and report answer accuracy (exact match)."""
    log_every: int = 1
    """Log metrics every N steps."""
    max_consecutive_skipped_steps: int = 5
    """An optimizer step whose loss or gradient norm is not finite is skipped (weights untouched),
    counted (`train/skipped_steps`) and logged; this many skipped steps in a row stop the run with an
    error before anything non-finite reaches the weights or a checkpoint (0 = never stop)."""

    def validate(self) -> None:
        if not self.output_dir.strip():  # "" is the current folder: checkpoints, lock and metrics land there
            raise ValueError("output_dir: must not be empty (the run folder)")
        if self.max_steps is not None and self.max_steps <= 0:
            raise ValueError(f"max_steps: must be > 0, got {self.max_steps}")
        if self.epochs is not None and self.epochs <= 0:
            raise ValueError(f"epochs: must be > 0, got {self.epochs}")
        if self.max_steps is not None and self.epochs is not None:  # max_steps would decide, epochs be ignored
            raise ValueError(f"epochs: set max_steps or epochs, not both (max_steps = {self.max_steps} would decide the "
                             f"run's length and epochs = {self.epochs} be ignored)")
        # "set max_steps or epochs" is checked by config.Config.validate: an evaluation job has no
        # length and [[stages]] may give each stage its own
        if any(not p.strip() for p in self.train_layers):  # an empty regex matches every name: nothing frozen
            raise ValueError(f"train_layers: an empty pattern matches every parameter (nothing would be frozen); got "
                             f"{self.train_layers}")
        if not 0 <= self.seed < 2**32:  # numpy refuses any other seed when the job starts (training/context.py)
            raise ValueError(f"seed: must be in [0, 2**32 - 1] (numpy's seed range), got {self.seed}")
        above(self, 0, "micro_batches_per_step", "log_every")
        at_least(self, 0, "max_grad_norm", "eval_every", "eval_max_batches")
        if self.fp8_recipe is not None and self.precision != "fp8":
            raise ValueError(f"fp8_recipe: only with precision = \"fp8\" (precision is {self.precision!r})")
        if self.max_consecutive_skipped_steps < 0:
            raise ValueError(f"max_consecutive_skipped_steps: must be >= 0 (0 = never stop), got {self.max_consecutive_skipped_steps}")


@dataclass(kw_only=True)
class OptimizerConfig:
    type: Literal["adamw"] = "adamw"
    """Optimizer (AdamW; the fused implementation is used on CUDA and CPU)."""
    lr: float = 1e-5
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Decoupled weight decay (not applied to biases and norm weights)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    moments_dtype: Literal["fp32", "bf16"] = "fp32"
    """Storage dtype of AdamW's two moments: fp32 (torch's fused AdamW), or bf16: 4 instead of 8 bytes of optimizer
    state per trainable parameter (14 GiB less at the Qwen2.5-VL-3B shape on one GPU), the moments computed in fp32
    each step and rounded stochastically to bf16 (unbiased, so beta2 = 0.999's small changes are not rounded away);
    the master weights and gradients keep `model.dtype`. `kernels.adamw_bf16_moments` picks the kernel (our fused
    Triton pass on CUDA, torch ops elsewhere). A checkpoint saved with the other dtype resumes (its moments
    converted)."""

    def validate(self) -> None:
        above(self, 0, "lr")
        at_least(self, 0, "weight_decay")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas: each must be in [0, 1), got {list(self.betas)}")
        above(self, 0, "eps")


@dataclass(kw_only=True)
class SchedulerConfig:
    type: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup."""
    warmup_steps: int = 0
    """Linear warmup steps (or warmup_ratio, not both; a `--set` of one replaces the file's other)."""
    warmup_ratio: float = 0.0
    """Warmup as a fraction of the total steps (e.g. 0.03: a short warmup that spares the first updates of
    a fine-tune from the full learning rate)."""
    min_lr_ratio: float = 0.0
    """Final lr as a fraction of the peak (cosine / linear; refused with constant, which never decays)."""

    def validate(self) -> None:
        at_least(self, 0, "warmup_steps")
        if self.warmup_steps > 0 and self.warmup_ratio > 0:  # warmup_steps would decide, warmup_ratio be ignored
            raise ValueError(f"warmup_ratio: set warmup_steps or warmup_ratio, not both (warmup_steps = {self.warmup_steps} "
                             f"would decide the warmup and warmup_ratio = {self.warmup_ratio} be ignored)")
        if self.type == "constant" and self.min_lr_ratio != SchedulerConfig.min_lr_ratio:
            raise ValueError(f"min_lr_ratio: not read with type = 'constant' (the lr stays at optimizer.lr after the "
                             f"warmup), got {self.min_lr_ratio}; remove it or use 'cosine' / 'linear'")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio: must be in [0, 1), got {self.warmup_ratio}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")


@dataclass(kw_only=True)
class ParallelConfig:
    backend: Literal["native", "mcore"] = "native"
    """native = our decoder layers, PyTorch FSDP2 / DTensor. mcore = the language decoder's layers are megatron-core
    TransformerLayers (Transformer Engine's fused modules when TE is installed; MoELayer for MoE decoders, the
    hybrid stack's Mamba / attention / MLP / MoE layers for Nemotron-H), converted exactly from the HF weights and
    back at export. Data, tensor (megatron-core's column / row parallel linears over our tp groups, MoE layers
    replicated over tp, Mamba2 mixers split by heads; plain tp inside the layer: its torch RMSNorms refuse
    sequence parallelism), context parallelism (the same layers split as native's, Mamba2 blocks whole; through
    our attention) and expert parallelism (ep > 1, MoE decoders and the Nemotron-H hybrid's MoE blocks:
    megatron-core's all-to-all token dispatcher over our ep groups, each rank holding its E / ep experts; with
    tp > 1 too, MoE layers replicated over tp) and pipeline parallelism (pp > 1 with data parallelism, as native: our
    1F1B schedule drives stages whose decoder layers are megatron-core layers; megatron-core's own pipeline size
    stays 1). `[lora]`: the native adapters taken over by the megatron-core layers (every layout, tp > 1
    included; docs/training.md "LoRA") (experimental: the local spec has run on one GPU, Transformer Engine's spec and multi-GPU layouts not yet; docs/backends.md)."""
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP outer dimension)."""
    dp_shard: int = -1
    """FSDP shard group size; -1 = all remaining ranks."""
    fsdp: Union[bool, Literal["auto"]] = "auto"
    """Whether the model becomes FSDP2 units. auto: everywhere except one CPU process in fp32 (nothing to shard,
    gather or cast there). false (one process, no tp / cp / pp / ep, the native backend): no FSDP2; in bf16 the model
    holds its weights in bf16 and the optimizer updates fp32 master copies beside them (gradients summed in fp32), the
    arithmetic of FSDP2's mixed precision on one rank without its per-step copies, casts and hooks; costs the
    bf16 weights of every parameter besides the masters (FSDP2 gathers one block at a time; --check counts it).
    true: FSDP2 units even where auto leaves them out."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (ZeRO-3) or keep them until backward (ZeRO-2)."""
    compile: bool = False
    """torch.compile each transformer block. The routed experts of MoE layers and Mamba2's packed conv / scan run
    eagerly inside it. With train.activation_checkpointing true such a layer's modules are compiled one by one
    (a checkpoint compiles whole or not at all), all but those parts: router, shared experts, Mamba2 projections
    and norms too. With "selective" such a layer is checkpointed per module instead, and its MoE / Mamba2 mixer
    per piece (router, shared experts, routed experts; Mamba2 projections, conv + scan, gated norm): the same
    parts compile, the eager ones in checkpoints of their own, and the checkpoints' inputs are kept too (per
    layer a hidden-size activation per norm, the routing weights, the Mamba2 scan output: about 10 % more
    activation memory at the Qwen3-MoE shape; counted by --check)."""
    ep: int = 1
    """Expert parallelism: shard each MoE block's routed experts over groups of `ep` ranks (tokens
    exchanged with all-to-all); must divide the number of processes and the expert count. EP ranks
    are data-parallel ranks too (each reads its own data); expert weights are left out of FSDP."""
    tp: int = 1
    """Tensor parallelism: shard each decoder layer's attention heads, Mamba2 heads and MLP columns over
    groups of `tp` consecutive ranks (sequence-parallel norms between them, vocab-parallel embedding and
    lm_head). The `tp` ranks of a group read the same data; must divide the number of processes, the
    attention and KV heads, the Mamba2 heads and groups, the MLP width and the vocabulary. Composes with cp."""
    cp: int = 1
    """Context parallelism (SFT and GRPO): the tokens of each packed sequence are split over groups of `cp`
    ranks (load-balanced causal chunks, attention over the all-gathered keys / values); the ranks of a
    group read the same packs. Divides the number of processes; data.max_tokens_per_pack must be
    divisible by 2 x cp. Mamba2 layers run the whole sequence on every cp rank. Not with ep > 1."""
    pp: int = 1
    """Pipeline stages of the language decoder (torch.distributed.pipelining, 1F1B schedule over the
    `train.micro_batches_per_step` micro-batches): the first stage also holds the embedding and the vision
    tower, the last the final norm and lm_head. Must divide the number of processes and be at most the
    number of decoder layers; SFT only, with data parallelism (not with tp, cp or ep > 1)."""

    def validate(self) -> None:
        at_least(self, 1, "cp", "pp")
        for key in ("tp", "cp", "ep"):
            if self.pp > 1 and getattr(self, key) > 1:
                raise ValueError(f"pp: pipeline parallelism (pp = {self.pp}) composes with data parallelism only; "
                                 f"{key} = {getattr(self, key)} must be 1")
        if self.cp > 1 and self.ep > 1:
            raise ValueError(f"cp: context parallelism (cp = {self.cp}) with expert parallelism (ep = {self.ep}) "
                             "is not supported; set one of them to 1")
        at_least(self, 1, "tp", "ep")
        above(self, 0, "dp_replicate")
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ValueError(f"dp_shard: must be -1 or > 0, got {self.dp_shard}")
        if self.fsdp is False:
            for key in ("tp", "cp", "pp", "ep", "dp_replicate"):
                if getattr(self, key) > 1:
                    raise ValueError(f"fsdp: false runs one process without parallelism; {key} = {getattr(self, key)} "
                                     "needs FSDP2 (fsdp = \"auto\")")
            if self.dp_shard > 1:
                raise ValueError(f"fsdp: false runs one process; dp_shard = {self.dp_shard} shards over FSDP2")
            if self.backend == "mcore":
                raise ValueError("fsdp: false is not supported with backend = 'mcore'; use fsdp = \"auto\"")
            if not self.reshard_after_forward:
                raise ValueError("reshard_after_forward: an FSDP2 setting; with fsdp = false there are no units to "
                                 "reshard (remove it)")
        if self.backend == "mcore" and self.compile:
            raise ValueError("backend: 'mcore' with compile = true is not supported yet; set compile = false")


@dataclass(kw_only=True)
class CheckpointConfig:
    PATHS: ClassVar[tuple[str, ...]] = ("resume",)  # filesystem paths: a leading ~ is expanded (config/loader.py)
    enable: bool = True
    """Write distributed checkpoints (model, optimizer, scheduler, data position, RNG, step). false stops writing
    only: `resume` still loads a checkpoint the folder (or the path it names) holds."""
    every_steps: int = 0
    """Save every N steps (0 = only at the end and on SIGTERM). Refused with enable = false (nothing is saved;
    `--set checkpoint.enable=false` drops the file's value)."""
    keep_last: int = 2
    """Keep the newest N complete checkpoints (0 = keep all). Refused with enable = false, as every_steps is."""
    resume: str = "auto"
    """"auto" = newest complete checkpoint in output_dir/checkpoints if any; "none"; or a checkpoint folder. A checkpoint
    resumes with the parallel.backend, [lora] (lora.r, adapted layers) and model family it was written with; a run
    with others exits 2 naming the key and both values (other data-parallel / native tp / cp / pp sizes reshard)."""
    export_hf: bool = True
    """At the end, export a Hugging Face folder (safetensors + config + tokenizer + processor) to output_dir/hf."""
    export_dtype: Optional[Literal["float32", "bfloat16"]] = None
    """dtype of the exported weights (the model folder, a LoRA run's merged model, a reward model folder): unset = as
    the run holds them (`model.dtype`, the fp32 master weights by default); "bfloat16" halves the folder, as hub
    checkpoints ship (tensors kept in fp32 on purpose, the MoE routers, stay fp32; config.json names the dtype).
    A LoRA adapter keeps its own dtype."""

    def validate(self) -> None:
        at_least(self, 0, "every_steps", "keep_last")
        for name in ("every_steps", "keep_last"):  # only the saving reads them
            if not self.enable and getattr(self, name) != getattr(CheckpointConfig, name):
                raise ValueError(f"{name}: only read with checkpoint.enable = true (it shapes the checkpoints a run "
                                 f"writes, and enable = false writes none), got {getattr(self, name)}; remove it or "
                                 "set enable = true")
        if self.export_dtype is not None and not self.export_hf:
            raise ValueError(f"export_dtype: {self.export_dtype!r} has no effect with export_hf = false (nothing is "
                             "exported)")


@dataclass(kw_only=True)
class LoggingConfig:
    console: bool = True
    """Progress bar and per-step lines on rank 0."""
    tensorboard: bool = True
    """TensorBoard event files in output_dir/tensorboard."""
    csv: bool = True
    """metrics_train.csv and metrics_eval.csv in output_dir."""
    wandb: bool = False
    """Log to Weights & Biases (needs the wandb package)."""
    wandb_project: str = "megatron-vlm"
    """W&B project (wandb_project, wandb_mode and experiment_name are refused with wandb = false)."""
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    """W&B mode; offline works without a network."""
    experiment_name: Optional[str] = None
    """Run name for W&B (default: the output_dir name; TensorBoard writes to output_dir/tensorboard)."""

    def validate(self) -> None:
        for name in ("wandb_project", "wandb_mode", "experiment_name"):  # only wandb.init reads them
            if not self.wandb and getattr(self, name) != getattr(LoggingConfig, name):
                raise ValueError(f"{name}: only read with logging.wandb = true (it configures the W&B run); remove it "
                                 "or set wandb = true")


@dataclass(kw_only=True)
class LoRAConfig:
    """[lora]: train low-rank adapters instead of the full weights (PEFT-compatible; see docs/training.md "LoRA")."""

    PATHS: ClassVar[tuple[str, ...]] = ("init_from",)  # filesystem paths: a leading ~ is expanded (config/loader.py)

    r: int = 8
    """Adapter rank."""
    alpha: float = 16.0
    """Scaling numerator: the update is (alpha / r) B A (alpha / sqrt(r) with use_rslora)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (training only)."""
    target_modules: list[str] = field(default_factory=list)
    """Layers to adapt, by their transformers (PEFT) module names: a plain name ("q_proj", or dotted:
    "self_attn.q_proj") matches the whole name or its last parts, as in PEFT's list; "all-linear" (PEFT's and
    ms-swift's shorthand) every linear layer in scope but the LM head; anything else is a regex matched against the
    whole name
    ("model\\.language_model\\.layers\\.[0-9]\\..*_proj"). Empty = the decoder's q/k/v/o/gate/up/down
    projections. Only linear layers with one Hugging Face counterpart (not fused there) can be adapted;
    routed MoE experts and the LM head never are."""
    include_vision: bool = False
    """Also adapt matching layers of the vision tower and projector (default: the language model only). Not with
    init_from and empty target_modules (the adapter's own layers are adapted)."""
    init: Literal["default", "gaussian"] = "default"
    """PEFT's initialisation: default = A Kaiming-uniform, B = 0; gaussian = A normal with standard deviation 1/r, B = 0.
    Not with init_from in "continue" mode (the adapter's factors replace it)."""
    use_rslora: bool = False
    """Rank-stabilised LoRA: scale by alpha / sqrt(r) instead of alpha / r."""
    init_from: str = ""
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors, e.g. an earlier stage's
    <output_dir>/adapter) to start from; its r / alpha / use_rslora must equal this section's."""
    init_from_mode: Literal["continue", "merge"] = "continue"
    """continue = train that adapter further (target_modules empty: its layers); merge = fold it into the
    base weights and train a new adapter (exports and the GRPO reference then include it)."""

    def validate(self) -> None:
        above(self, 0, "r", "alpha")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout: must be in [0, 1), got {self.dropout}")
        if self.init_from_mode != "continue" and not self.init_from:
            raise ValueError("init_from_mode: only meaningful with init_from")
        if self.init_from and self.init_from_mode == "continue" and self.init != LoRAConfig.init:
            raise ValueError(f"init: the continued adapter's factors (init_from, init_from_mode = \"continue\") replace "
                             f"the initialisation, so {self.init!r} has no effect; remove it (it shapes the new adapter of "
                             "init_from_mode = \"merge\")")
        if self.init_from and not self.target_modules and self.include_vision:
            raise ValueError("include_vision: with lora.init_from and no target_modules the adapter's own layers are "
                             "adapted, vision ones included if it has them; remove it, or name the layers in target_modules")
