"""InternVL (InternVL2.5 / InternVL3 / InternVL3.5 with Qwen2 / Qwen2.5 / Qwen3 LLMs): InternViT + pixel
shuffle + MLP projector + decoder. Reads transformers' (`internvl`) and OpenGVLab's (`internvl_chat`)
checkpoints; exports transformers' layout."""
from megatron_vlm.models.internvl.args import InternVisionArgs, InternVLArgs, InternVLTextArgs
from megatron_vlm.models.internvl.model import InternVLForConditionalGeneration
from megatron_vlm.models.internvl.parallelize import parallelize_internvl
from megatron_vlm.models.internvl.state_dict_adapter import InternVLStateDictAdapter
from megatron_vlm.models.registry import ModelFamily

FAMILY = ModelFamily(
    name="internvl",
    args_cls=InternVLArgs,
    model_cls=InternVLForConditionalGeneration,
    state_dict_adapter=InternVLStateDictAdapter,
    parallelize=parallelize_internvl,
)

__all__ = [
    "FAMILY", "InternVisionArgs", "InternVLArgs", "InternVLTextArgs", "InternVLForConditionalGeneration",
    "InternVLStateDictAdapter", "parallelize_internvl",
]
