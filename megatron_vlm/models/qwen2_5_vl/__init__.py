"""Qwen2.5-VL (3B / 7B / 32B / 72B): window-attention ViT + Qwen2 decoder with M-RoPE."""
from megatron_vlm.models.qwen2_5_vl.args import Qwen2_5_VLArgs, Qwen2_5_VLTextArgs, Qwen2_5_VLVisionArgs
from megatron_vlm.models.qwen2_5_vl.model import Qwen2_5_VLForConditionalGeneration
from megatron_vlm.models.qwen2_5_vl.parallelize import parallelize_qwen2_5_vl
from megatron_vlm.models.qwen2_5_vl.state_dict_adapter import Qwen2_5_VLStateDictAdapter
from megatron_vlm.models.registry import ModelFamily

FAMILY = ModelFamily(
    name="qwen2_5_vl",
    args_cls=Qwen2_5_VLArgs,
    model_cls=Qwen2_5_VLForConditionalGeneration,
    state_dict_adapter=Qwen2_5_VLStateDictAdapter,
    parallelize=parallelize_qwen2_5_vl,
)

__all__ = [
    "FAMILY", "Qwen2_5_VLArgs", "Qwen2_5_VLTextArgs", "Qwen2_5_VLVisionArgs", "Qwen2_5_VLForConditionalGeneration",
    "Qwen2_5_VLStateDictAdapter", "parallelize_qwen2_5_vl",
]
