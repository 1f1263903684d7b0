"""The qwen2_5_vl `ModelFamily` entry (args, module, state-dict adapter, parallelize) read by `models.registry`."""
from megatron_vlm.models.qwen2_5_vl.args import Qwen2_5_VLArgs
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
