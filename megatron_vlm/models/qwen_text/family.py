"""The qwen_text `ModelFamily` entry (args, module, state-dict adapter, parallelize) read by `models.registry`;
one family serves `qwen2`, `qwen3` and `qwen3_moe`."""
from megatron_vlm.models.qwen_text.args import QwenTextArgs
from megatron_vlm.models.qwen_text.model import QwenTextForCausalLM
from megatron_vlm.models.qwen_text.parallelize import parallelize_qwen_text
from megatron_vlm.models.qwen_text.state_dict_adapter import QwenTextStateDictAdapter
from megatron_vlm.models.registry import ModelFamily

FAMILY = ModelFamily(
    name="qwen_text",
    args_cls=QwenTextArgs,
    model_cls=QwenTextForCausalLM,
    state_dict_adapter=QwenTextStateDictAdapter,
    parallelize=parallelize_qwen_text,
)
