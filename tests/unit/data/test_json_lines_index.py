"""Opening a JSON-lines file holds its index as int64 arrays, not as Python lists of ints.

The index (each good line's 1-based number and byte offset) used to be built in two Python lists and copied into
int64 arrays at the end: a list slot and an int object per number, about 72 bytes per row while the file was opened
(each rank opens every file), against 16 in the arrays kept. It is now built in `array("q")` as the JSON array
files' index is (test_json_array_streaming.py). Measured with tracemalloc on a file of many short rows."""
from __future__ import annotations

import tracemalloc

from megatron_vlm.data.table_rows import TableRows

ROWS = 200_000


def test_opening_a_json_lines_file_holds_its_index_in_arrays(tmp_path):
    path = tmp_path / "many.jsonl"
    with open(path, "w") as f:
        f.write("".join(f'{{"q": {i}}}\n' for i in range(ROWS)))
    tracemalloc.start()
    try:
        rows = TableRows(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(rows) == ROWS and rows.row(ROWS - 1) == {"q": ROWS - 1} and rows.locate(ROWS - 1)[1] == ROWS
    # the arrays being built and their int64 copy: 32 bytes a row, with room for the file's reading
    assert peak / ROWS < 48, f"opening {ROWS} rows peaked at {peak / ROWS:.0f} bytes a row ({peak / 2**20:.1f} MiB)"
