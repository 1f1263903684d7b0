"""Qwen3-VL (2B / 4B / 8B / 32B) and Qwen3-VL-MoE (30B-A3B / 235B-A22B): ViT with DeepStack + Qwen3
(or Qwen3-MoE) decoder with interleaved M-RoPE. One family serves both `model_type`s."""
from megatron_vlm.models.qwen3_vl.args import Qwen3VLArgs, Qwen3VLTextArgs, Qwen3VLVisionArgs
from megatron_vlm.models.qwen3_vl.model import Qwen3VLForConditionalGeneration
from megatron_vlm.models.qwen3_vl.parallelize import parallelize_qwen3_vl
from megatron_vlm.models.qwen3_vl.state_dict_adapter import Qwen3VLStateDictAdapter
from megatron_vlm.models.registry import ModelFamily

FAMILY = ModelFamily(
    name="qwen3_vl",
    args_cls=Qwen3VLArgs,
    model_cls=Qwen3VLForConditionalGeneration,
    state_dict_adapter=Qwen3VLStateDictAdapter,
    parallelize=parallelize_qwen3_vl,
)

__all__ = [
    "FAMILY", "Qwen3VLArgs", "Qwen3VLTextArgs", "Qwen3VLVisionArgs", "Qwen3VLForConditionalGeneration",
    "Qwen3VLStateDictAdapter", "parallelize_qwen3_vl",
]
