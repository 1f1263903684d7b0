"""Nemotron-H (hybrid Mamba2 / attention / MoE decoder) and Nemotron-3-Nano-VL (RADIO + projector, or the
Qwen3-VL vision tower with its patch merger and DeepStack: see args.py for the config layouts)."""
from megatron_vlm.models.nemotron_vl.args import NemotronHTextArgs, NemotronVLArgs, RadioVisionArgs
from megatron_vlm.models.nemotron_vl.cache import HybridCache
from megatron_vlm.models.nemotron_vl.model import NemotronVLForConditionalGeneration
from megatron_vlm.models.nemotron_vl.parallelize import parallelize_nemotron_vl
from megatron_vlm.models.nemotron_vl.state_dict_adapter import NemotronVLStateDictAdapter
from megatron_vlm.models.registry import ModelFamily

FAMILY = ModelFamily(
    name="nemotron_vl",
    args_cls=NemotronVLArgs,
    model_cls=NemotronVLForConditionalGeneration,
    state_dict_adapter=NemotronVLStateDictAdapter,
    parallelize=parallelize_nemotron_vl,
)

__all__ = [
    "FAMILY", "NemotronHTextArgs", "NemotronVLArgs", "RadioVisionArgs", "HybridCache",
    "NemotronVLForConditionalGeneration", "NemotronVLStateDictAdapter", "parallelize_nemotron_vl",
]
