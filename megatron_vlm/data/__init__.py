"""Data pipeline shared by every model family and by SFT and GRPO.

Files (`data_files.py`, read row by row by the one reader `table_rows.py`) -> sources (messages
JSONL, Hugging Face datasets files mapped by `[data] columns`, the synthetic VQA set) -> processing with the model
folder's chat template and processor (labels on assistant tokens only) -> first-fit packing into
token budgets with `cu_seqlens` -> a resumable, rank-sharded DataLoader (`loader.py`). Bad records
are skipped and logged (`bad_records.py`). Submodules are imported lazily by their users so that
`import megatron_vlm.data.config` stays cheap for the config loader.
"""
