"""Data pipeline shared by every model family and by SFT and GRPO.

Files (`data_files.py`, read row by row by the one reader `table_rows.py`) -> sources (messages
JSONL, Hugging Face datasets files mapped by `[data] columns`, the synthetic VQA set) -> processing with the model
folder's chat template and processor (labels on assistant tokens only) -> first-fit packing into
token budgets with `cu_seqlens` -> a resumable, rank-sharded DataLoader (`loader.py`). Bad records
are skipped and logged (`bad_records.py`). A sample longer than `max_tokens_per_pack` is one of them
("too_long"): skipped and counted, never truncated, since a cut-off answer would be trained as a
complete one (GRPO leaves over-long prompts out at start-up the same way: rl/prompts/lengths.py). A
split with no usable record, or a path that cannot be read at all, is a config error (exit 2). Submodules are imported lazily by their users so that
`import megatron_vlm.data.config` stays cheap for the config loader.
"""
