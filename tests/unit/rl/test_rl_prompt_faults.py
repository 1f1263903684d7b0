"""GRPO: every per-prompt failure is a counted bad record, never a crashed run.

A decompression-bomb image (PIL's DecompressionBombError) used to escape `PromptEncoder.encode` and
crash the step, and again after a resume; a row whose messages are not objects escaped
`load_prompt_dataset` as an AttributeError. Now both are bad records under the prompt's file and
line, unexpected exceptions as "unexpected_error" with their type and message (the first logged with
a traceback), and `load_prompt_sets` can hand the rows it left out to the run's log.
"""
from __future__ import annotations

import json
import logging
import struct
import zlib
from types import SimpleNamespace

import pytest
from PIL import Image

import megatron_vlm.data.bad_records as bad_records_mod
from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
from megatron_vlm.rl.prompts.encoder import PromptEncoder
from megatron_vlm.rl.prompts.sets import load_prompt_sets


def write_png_bomb(path, side: int):
    """A valid 1-bit greyscale PNG of side x side pixels, all zero: tens of KB on disk, gigabytes decoded."""
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    comp = zlib.compressobj(9)
    row = b"\0" * (1 + (side + 7) // 8)
    idat = b"".join(comp.compress(row) for _ in range(side)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b""))
    return path


@pytest.fixture
def write_image():
    def write(path, size):
        Image.new("RGB", size, (200, 30, 30)).save(path)
        return path
    return write


def _row(image: str, q: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": [{"type": "image", "image": image},
                                                                 {"type": "text", "text": q}]},
                                    {"role": "assistant", "content": "x"}]}) + "\n"


def _prompts(tmp_path, write_image, bomb_side=20_000):
    write_image(tmp_path / "ok.png", size=(56, 56))
    write_png_bomb(tmp_path / "bomb.png", bomb_side)
    path = tmp_path / "prompts.jsonl"
    path.write_text(_row("ok.png", "What colour?") + _row("bomb.png", "What shape?"))
    return path, load_prompt_dataset(path, schema="messages")


@pytest.mark.parametrize("bomb_side", [20_000, 9_000])
def test_decompression_bomb_prompt_is_a_bad_record_also_after_resume(tmp_path, proc, write_image, bomb_side):
    path, ds = _prompts(tmp_path, write_image, bomb_side)
    assert len(ds) == 2  # rows are read without decoding images
    log = BadRecordLog()
    enc = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=8, max_tokens=4096, bad_records=log)
    assert enc.encode(ds[0]) is not None
    assert enc.encode(ds[1]) is None and enc.skipped == 1
    # a resumed run meets the same prompt again with a fresh encoder: skipped again, counted again
    again = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=8, max_tokens=4096, bad_records=log)
    assert again.encode(ds[1]) is None
    (bad,) = log.entries
    assert (bad.source, bad.index, bad.category) == (str(path), 2, "image_too_large")
    assert log.to_dict()["records"][0]["skips"] == 2


def test_prompt_pixel_cap_comes_from_the_limits(tmp_path, proc, write_image):
    from megatron_vlm.data.media import MediaLimits

    _, ds = _prompts(tmp_path, write_image)
    enc = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=8, max_tokens=4096,
                        limits=MediaLimits(max_image_pixels=56 * 56 - 1))
    assert enc.encode(ds[0]) is None
    assert enc.bad_records.entries[0].category == "image_too_large"


def test_unexpected_exception_while_encoding_is_counted_with_type_and_warned_once(tmp_path, proc, write_image,
                                                                                  monkeypatch, caplog):
    import megatron_vlm.rl.prompts.encoder as prompts_mod

    path, ds = _prompts(tmp_path, write_image)

    def broken(*a, **kw):
        raise ZeroDivisionError("division by zero in a processor")

    monkeypatch.setattr(prompts_mod, "process_record", broken)
    monkeypatch.setattr(bad_records_mod, "_warned_unexpected", False)
    enc = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=8, max_tokens=4096)
    with caplog.at_level(logging.WARNING, logger="megatron_vlm"):
        assert enc.encode(ds[0]) is None and enc.encode(ds[1]) is None
    assert [(b.index, b.category, b.detail) for b in enc.bad_records.entries] == [
        (1, "unexpected_error", "ZeroDivisionError: division by zero in a processor"),
        (2, "unexpected_error", "ZeroDivisionError: division by zero in a processor")]
    tracebacks = [r for r in caplog.records if r.exc_info and "unexpected ZeroDivisionError" in r.getMessage()]
    assert len(tracebacks) == 1


def test_too_long_prompt_is_counted_by_file_and_line(tmp_path, proc, write_image):
    path, ds = _prompts(tmp_path, write_image)
    enc = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=8, max_tokens=20)
    assert enc.encode(ds[0]) is None
    assert [(b.source, b.index, b.category) for b in enc.bad_records.entries] == [(str(path), 1, "too_long")]


def test_row_that_breaks_the_mapping_is_skipped_not_fatal(tmp_path, monkeypatch):
    import megatron_vlm.rl.prompts.dataset as dataset

    path = tmp_path / "p.jsonl"
    good = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"messages": ["not an object"]}) + "\n")
    out = load_prompt_dataset(path, schema="messages")
    assert len(out) == 1
    (bad,) = out.bad_records.entries
    assert (bad.index, bad.category) == (2, "invalid_record") and "messages[0]" in bad.detail
    # any other exception while mapping one row: counted as unexpected, the run goes on
    real = dataset._from_messages_row

    def breaks_on_the_second(row, *args):
        if row.get("messages", [None])[0] == "boom":
            raise AttributeError("'str' object has no attribute 'get'")
        return real(row, *args)

    monkeypatch.setattr(dataset, "_from_messages_row", breaks_on_the_second)
    path.write_text(json.dumps(good) + "\n" + json.dumps({"messages": ["boom"]}) + "\n")
    out = load_prompt_dataset(path, schema="messages")
    assert len(out) == 1
    (bad,) = out.bad_records.entries
    assert (bad.index, bad.category) == (2, "unexpected_error") and bad.detail.startswith("AttributeError: ")


def test_load_prompt_sets_hands_left_out_rows_to_the_run_log(tmp_path):
    path = tmp_path / "p.jsonl"
    good = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]}
    path.write_bytes(json.dumps(good).encode() + b"\n" + b'{"messages": "\xff"}\n')
    data_cfg = SimpleNamespace(type="messages_jsonl", train_path=str(path), eval_path="", image_root="")
    rl_cfg = SimpleNamespace(prompts=SimpleNamespace(template="{problem}", system_prompt=None))
    log = BadRecordLog()
    sets = load_prompt_sets(data_cfg, rl_cfg, run_dir=tmp_path, bad_records=log)
    assert len(sets.train) == 1 and sets.eval is None
    assert [(b.source, b.index, b.category) for b in log.entries] == [(str(path), 2, "invalid_encoding")]


def test_a_step_with_no_encodable_prompt_is_a_config_error_naming_one(tmp_path, proc, write_image):
    """Every prompt of a step bad (here too long; a text-only model given image prompts ends the same way): the
    run cannot go on, and it is the data or the model choice, so ConfigError (exit 2, one line naming the last
    skipped prompt and why), not a RuntimeError traceback."""
    import torch

    from megatron_vlm.config.loader import ConfigError
    from megatron_vlm.rl.prompts.shard import encode_shard

    path, ds = _prompts(tmp_path, write_image)
    enc = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=8, max_tokens=20)
    with pytest.raises(ConfigError, match=r"^data: none of the 1 prompts .*last one skipped: .*too_long"):
        encode_shard([ds[0]], enc, 0, 1, torch.device("cpu"))
    shard = encode_shard([ds[0]], PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=8, max_tokens=4096), 0, 1,
                         torch.device("cpu"))
    assert shard.num_real == 1
