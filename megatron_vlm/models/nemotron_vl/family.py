"""The nemotron_vl `ModelFamily` entry (args, module, state-dict adapter, parallelize) read by `models.registry`."""
from megatron_vlm.models.nemotron_vl.args import NemotronVLArgs
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
