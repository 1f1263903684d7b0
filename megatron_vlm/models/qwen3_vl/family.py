"""The qwen3_vl `ModelFamily` entry (args, module, state-dict adapter, parallelize) read by `models.registry`."""
from megatron_vlm.models.qwen3_vl.args import Qwen3VLArgs
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
