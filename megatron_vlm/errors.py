"""`ConfigError`, the one exception class that means "the configuration asks for something this run cannot
do": the entry point prints its message (which starts with the dotted key) on one line and exits 2.

Why a top-level module: the error is raised where the problem is found, which is often long after the
config was loaded (the data reader finding no usable record, a `train.train_layers` pattern matched
against the built model, a GRPO step whose prompts cannot be encoded). Those packages must not import
`megatron_vlm.config`, which imports their section dataclasses (tests/unit/test_import_graph.py);
`megatron_vlm.config` re-exports the class from here."""
from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration problem; the message names the dotted key."""
