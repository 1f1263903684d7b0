"""Checkpoints: Hugging Face import / export (`hf`) and distributed resume checkpoints (`manager`)."""
from megatron_vlm.checkpoint.hf import copy_tokenizer_files, load_hf_model, read_hf_config, save_hf_model

__all__ = ["copy_tokenizer_files", "load_hf_model", "read_hf_config", "save_hf_model"]
