"""Text-only Qwen causal LMs (Qwen2 / Qwen2.5 / Qwen2.5-Math, Qwen3, Qwen3-MoE) on the VLMs' decoder.

Architecture only. The decoder is not re-implemented here: `language_model` is the Qwen2.5-VL
family's `Qwen2_5_VLTextModel` (qwen2) or the Qwen3-VL family's `Qwen3VLTextModel` (qwen3,
qwen3_moe), built with `mrope_section = None` so its rotary is 1-D RoPE. Attention, MLP / MoE,
norms, kernels, KV cache, FSDP / AC units and expert parallelism are therefore the VLMs' own.
Forward matches `transformers.Qwen2ForCausalLM` / `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM`.

`forward` takes the VLMs' batch schema (`data.batch.MODEL_INPUT_KEYS`) so the trainer, the
evaluators and the rollout engine call it unchanged: the vision inputs must be absent (an error
otherwise), `mm_token_type_ids` / `second_per_grid_ts` are accepted and unused. Input forms: padded
batch (+ attention_mask, left or right padding: positions count real tokens), packed (input_ids
[1, T] + `cu_seqlens`; positions restart per sample), decoding with a `KVCache` from `new_cache`
(positions continue after the cached real tokens). See `models/common/text_positions.py`.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from megatron_vlm.models.common.moe import MoE
from megatron_vlm.models.common.vlm_base import KVCacheMixin, TextPositionsMixin, VLMBase
from megatron_vlm.models.qwen2_5_vl.model import Qwen2_5_VLTextModel
from megatron_vlm.models.qwen3_vl.model import Qwen3VLTextModel
from megatron_vlm.models.qwen_text.args import QwenTextArgs


class QwenTextForCausalLM(TextPositionsMixin, KVCacheMixin, VLMBase):
    """`language_model` (the shared Qwen decoder), `lm_head` (shares the embedding Parameter when tied)."""

    def __init__(self, args: QwenTextArgs, hf_config: Optional[dict] = None) -> None:
        super().__init__(args, hf_config)
        decoder = Qwen2_5_VLTextModel if args.model_type == "qwen2" else Qwen3VLTextModel
        self.language_model = decoder(args.text)
        self.lm_head = nn.Linear(args.text.hidden_size, args.text.vocab_size, bias=False)
        self.tie_weights()

    def _init_module(self, module: nn.Module, std: float) -> None:
        if isinstance(module, MoE):  # expert weights are Parameters of the MoE block, not Linear modules
            module.reset_parameters(std)

    # ----- forward (the template is VLMBase.forward) -----
    _ignores = frozenset({"second_per_grid_ts", "mm_token_type_ids"})

    def _refuse(self, names: list[str]) -> None:
        raise ValueError(f"{self.args.model_type} is a text-only model: got inputs it does not take {names}")
