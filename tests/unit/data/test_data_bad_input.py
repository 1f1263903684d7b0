"""Bad input is a counted bad record, never a failed load or a crashed run.

- a JSON line that is not UTF-8, or nested deeper than the JSON parser's recursion limit, is one
  bad record (by file and 1-based line) in SFT (messages JSONL, hf JSONL) and GRPO alike;
- a decompression-bomb image (a small PNG whose header declares 20000 x 20000 pixels) is refused
  from its header ("image_too_large"), and `data.max_image_pixels` caps images below PIL's limit;
- the new `[data]` keys are validated.
All fixtures are written here; nothing is downloaded.
"""
from __future__ import annotations

import json
import struct
import zlib

import pytest

from megatron_vlm.config.loader import ConfigError, from_dict
from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.hf_source import HFRecords
from megatron_vlm.data.loader import build_sft_dataloader
from megatron_vlm.data.messages import read_messages_jsonl
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset

DEEP = 10_000


def _line(i: int, image: str | None = None) -> bytes:
    content = [{"type": "text", "text": f"question {i}"}]
    if image:
        content.insert(0, {"type": "image", "image": image})
    return json.dumps({"messages": [{"role": "user", "content": content},
                                    {"role": "assistant", "content": f"answer {i}"}]}).encode() + b"\n"


BAD_LINES = {
    "invalid_utf8": (b'{"messages": [{"role": "user", "content": "caf\xe9 \xff\xfe"}]}\n', "invalid_encoding"),
    "deep_nesting": (b'{"messages": ' + b"[" * DEEP + b"]" * DEEP + b"}\n", "malformed_json"),
}


def _where(log: BadRecordLog) -> list[tuple[str, int, str]]:
    return sorted((b.source, b.index, b.category) for b in log.entries)


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_bad_json_line_is_one_counted_bad_record_in_sft_and_grpo(tmp_path, kind):
    bad_line, category = BAD_LINES[kind]
    path = tmp_path / "train.jsonl"
    path.write_bytes(_line(0) + bad_line + _line(2))
    log = BadRecordLog()
    records = read_messages_jsonl(path, bad_records=log)
    assert [r.index for r in records] == [1, 3]
    assert _where(log) == [(str(path), 2, category)]

    grpo = load_prompt_dataset(path, schema="messages")
    assert [s.index for s in grpo.samples] == [1, 3]
    assert _where(grpo.bad_records) == [(str(path), 2, category)]
    assert grpo.skipped[0][0] == "train.jsonl:2"

    hf_log = BadRecordLog()
    hf = HFRecords(path, {"messages": "messages"}, bad_records=hf_log)
    assert len(hf) == 2 and _where(hf_log) == [(str(path), 2, category)]


def test_utf8_byte_order_mark_and_non_ascii_text_are_fine(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + _line(0) + json.dumps({"messages": [
        {"role": "user", "content": "caf\u00e9 \u2603"}, {"role": "assistant", "content": "\u00fcber"}]},
        ensure_ascii=False).encode("utf-8") + b"\n")
    log = BadRecordLog()
    records = read_messages_jsonl(path, bad_records=log)
    assert len(records) == 2 and len(log) == 0
    assert records[1].messages[1]["content"] == "\u00fcber"


def write_png_bomb(path, side: int = 20_000):
    """A valid 1-bit greyscale PNG of side x side pixels, all zero: tens of KB on disk, gigabytes decoded."""
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    comp = zlib.compressobj(9)
    row = b"\0" * (1 + (side + 7) // 8)  # filter byte + packed bits
    idat = b"".join(comp.compress(row) for _ in range(side)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b""))
    return path


@pytest.mark.parametrize("side, detail", [
    (20_000, "400000000 pixels"),  # over PIL's own refusal limit: its DecompressionBombError, same category
    (9_000, "9000 x 9000 = 81000000 pixels > data.max_image_pixels = 67108864"),  # under PIL's: our header cap
])
def test_decompression_bomb_is_skipped_from_its_header_in_sft(tmp_path, proc, write_image, side, detail):
    bomb = write_png_bomb(tmp_path / "bomb.png", side)
    assert bomb.stat().st_size < 200_000
    write_image(tmp_path / "ok.png", size=(56, 56))
    path = tmp_path / "train.jsonl"
    path.write_bytes(_line(0, "ok.png") + _line(1, str(bomb)) + _line(2))
    cfg = DataConfig(type="messages_jsonl", train_path=str(path), num_workers=0, max_tokens_per_pack=512)
    loader = build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
    pack = next(iter(loader))
    assert int(pack["num_samples"]) >= 1
    assert _where(loader.bad_records) == [(str(path), 2, "image_too_large")]
    assert detail in loader.bad_records.entries[0].detail


def test_max_image_pixels_caps_images_from_the_header(tmp_path, proc, write_image):
    write_image(tmp_path / "small.png", size=(28, 28))
    write_image(tmp_path / "big.png", size=(56, 56))
    path = tmp_path / "train.jsonl"
    path.write_bytes(_line(0, "small.png") + _line(1, "big.png"))
    cfg = DataConfig(type="messages_jsonl", train_path=str(path), num_workers=0, max_image_pixels=56 * 56 - 1)
    loader = build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
    assert int(next(iter(loader))["num_samples"]) == 1
    (bad,) = loader.bad_records.entries
    assert (bad.index, bad.category) == (2, "image_too_large")
    assert "56 x 56 = 3136 pixels > data.max_image_pixels = 3135" in bad.detail


def test_unexpected_exception_of_one_record_is_counted_with_its_type(tmp_path, proc, monkeypatch):
    import megatron_vlm.data.bad_records as bad_records_mod
    import megatron_vlm.data.loader as loader_mod

    path = tmp_path / "train.jsonl"
    path.write_bytes(_line(0) + _line(1))
    real = loader_mod.process_record

    def flaky(rec, *a, **kw):
        if rec.index == 2:
            raise KeyError("no such field")
        return real(rec, *a, **kw)

    monkeypatch.setattr(loader_mod, "process_record", flaky)
    monkeypatch.setattr(bad_records_mod, "_warned_unexpected", False)
    cfg = DataConfig(type="messages_jsonl", train_path=str(path), num_workers=0, shuffle=False)
    loader = build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
    next(iter(loader))
    (bad,) = loader.bad_records.entries
    assert (bad.index, bad.category, bad.detail) == (2, "unexpected_error", "KeyError: 'no such field'")


@pytest.mark.parametrize("extra", ["prompt", "answer"])  # "video" is read: the conversation's video (LLaVA-Video)
def test_columns_beside_messages_that_nothing_reads_are_refused(extra):
    with pytest.raises(ConfigError, match=rf"^data.columns: '{extra}' is not read beside 'messages'"):
        from_dict(DataConfig, {"type": "hf", "columns": {"messages": "m", extra: "x"}}, "data")
    from_dict(DataConfig, {"type": "hf", "columns": {"messages": "m", "image": "i", "system": "s"}}, "data")


@pytest.mark.parametrize("key, value, expect", [
    ("max_image_pixels", 0, "data.max_image_pixels: must be > 0"),
    ("max_video_pixels", -1, "data.max_video_pixels: must be > 0"),
    ("video_decode_timeout_s", 0.0, "data.video_decode_timeout_s: must be > 0"),
    ("loader_timeout_s", -1.0, "data.loader_timeout_s: must be >= 0"),
    ("video_decode_timeout_s", float("nan"), "data.video_decode_timeout_s: must be finite, got nan"),
])
def test_new_data_keys_are_validated(key, value, expect):
    with pytest.raises(ConfigError) as e:
        from_dict(DataConfig, {"type": "synthetic_vqa", key: value}, "data")
    assert str(e.value).startswith(expect), str(e.value)
    ok = from_dict(DataConfig, {"type": "synthetic_vqa", "loader_timeout_s": 0.0}, "data")  # 0 = no timeout
    assert ok.loader_timeout_s == 0.0 and ok.max_image_pixels == 8192 * 8192


def test_a_split_with_no_usable_record_is_a_config_error_naming_the_reason(tmp_path, proc, write_image):
    """Every record bad (here: missing images) or every record over the pack budget: the job cannot train, a
    config / data mistake (a text-only model given image records ends the same way). ConfigError (exit 2,
    one line) with the first bad record, not a ValueError traceback before any summary is written."""
    path = tmp_path / "train.jsonl"
    path.write_bytes(_line(0, "gone.png") + _line(1, "gone.png"))
    cfg = DataConfig(type="messages_jsonl", train_path=str(path), num_workers=0, max_tokens_per_pack=512)
    with pytest.raises(ConfigError, match=r"data\.train: no usable samples \(2 records.*missing_image.*train\.jsonl:1"):
        build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
    write_image(tmp_path / "ok.png", size=(56, 56))
    path.write_bytes(_line(0, "ok.png"))
    cfg = DataConfig(type="messages_jsonl", train_path=str(path), num_workers=0, max_tokens_per_pack=16)
    with pytest.raises(ConfigError, match=r"max_tokens_per_pack=16.*too_long"):
        build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
