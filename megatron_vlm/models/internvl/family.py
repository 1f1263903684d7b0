"""The internvl `ModelFamily` entry (args, module, state-dict adapter, parallelize) read by `models.registry`."""
from megatron_vlm.models.internvl.args import InternVLArgs
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
