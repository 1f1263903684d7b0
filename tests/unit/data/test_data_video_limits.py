"""Video files cost only what is used, and a bad one is a bad record.

No video decoder library is needed: a stand-in `VideoDecoder` (installed with `set_video_decoder`)
counts what it is asked for. Planning a pack (`estimate_length`) reads the metadata only; processing
decodes only the sampled frames; sampled frames x pixels over `data.max_video_pixels` is refused
before decoding (video files and frame lists); a decoder that hangs becomes a "timeout" bad record
after `data.video_decode_timeout_s` (the run goes on); a DataLoader worker that is stuck entirely
stops the run with an error naming `data.loader_timeout_s` instead of hanging it.
"""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

import megatron_vlm.data.media as media
from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.loader import build_sft_dataloader
from megatron_vlm.data.media import MediaLimits, VideoInfo, read_video, set_video_decoder, subsample_indices
from megatron_vlm.data.messages import Record, normalize_messages
from megatron_vlm.data.processing import estimate_length, process_record


class FakeDecoder:
    """A video of `n` frames of `size` (w, h) whose frame i is filled with the value i; `hang` makes
    "probe" or "decode" block until `release` is set."""

    def __init__(self, n=40, size=(56, 56), fps=10.0, hang=None):
        self.n, self.size, self.fps, self.hang = n, size, fps, hang
        self.probes, self.decoded = 0, []
        self.release = threading.Event()

    def probe(self, src):
        self.probes += 1
        if self.hang == "probe":
            self.release.wait(30)
        return VideoInfo(self.n, self.fps, self.size[1], self.size[0])

    def decode(self, src, indices):
        self.decoded.append(list(indices))
        if self.hang == "decode":
            self.release.wait(30)
        w, h = self.size
        return [np.full((h, w, 3), i % 256, dtype=np.uint8) for i in indices]


@pytest.fixture
def decoder():
    fake = FakeDecoder()
    previous = set_video_decoder(fake)
    yield fake
    fake.release.set()
    set_video_decoder(previous)


def _video_record(path, **extra):
    raw = [{"role": "user", "content": [{"type": "video", "video": str(path), **extra},
                                        {"type": "text", "text": "What happens?"}]},
           {"role": "assistant", "content": "nothing"}]
    return Record(normalize_messages(raw), "mem", 1)


@pytest.fixture
def clip(tmp_path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(b"not decoded by the stand-in")
    return path


def test_planning_reads_metadata_only_and_processing_decodes_only_sampled_frames(proc, decoder, clip):
    rec = _video_record(clip)
    n = estimate_length(rec, proc, max_frames=4)
    assert decoder.probes == 1 and decoder.decoded == []  # planning: no frame decoded
    out = process_record(rec, proc, max_frames=4)
    assert decoder.decoded == [subsample_indices(40, 4)] == [[0, 13, 26, 39]]
    assert len(out) == n and out.video_grid_thw is not None
    c = read_video({"video": str(clip)}, 4, 2.0)
    assert c.total_frames == 40 and c.fps == 10.0 and [np.asarray(f)[0, 0, 0] for f in c.frames] == [0, 13, 26, 39]


def test_frames_times_pixels_over_the_cap_is_refused_before_decoding(proc, decoder, clip):
    rec = _video_record(clip)
    tight = MediaLimits(max_video_pixels=4 * 56 * 56 - 1)
    with pytest.raises(BadRecordError) as e:
        estimate_length(rec, proc, max_frames=4, limits=tight)
    assert e.value.category == "video_too_large" and "4 frames x 56 x 56 = 12544 pixels" in str(e.value)
    with pytest.raises(BadRecordError, match="video_too_large"):
        process_record(rec, proc, max_frames=4, limits=tight)
    assert decoder.decoded == []
    process_record(rec, proc, max_frames=3, limits=tight)  # fewer sampled frames fit
    with pytest.raises(BadRecordError, match="image_too_large"):  # one frame over the image cap
        read_video({"video": str(clip)}, 4, 2.0, limits=MediaLimits(max_image_pixels=56 * 56 - 1))


def test_frame_list_video_is_capped_from_the_first_header(proc, tmp_path, write_image):
    frames = [str(write_image(tmp_path / f"f{i}.png", size=(56, 56), seed=i)) for i in range(6)]
    with pytest.raises(BadRecordError, match="video_too_large"):
        read_video({"video": frames}, 4, 2.0, decode=False, limits=MediaLimits(max_video_pixels=4 * 56 * 56 - 1))
    assert read_video({"video": frames}, 4, 2.0, limits=MediaLimits(max_video_pixels=4 * 56 * 56)).num_frames == 4


@pytest.mark.parametrize("stage", ["probe", "decode"])
def test_a_hanging_decoder_times_out_as_a_bad_record(proc, decoder, clip, stage):
    decoder.hang = stage
    rec = _video_record(clip)
    t0 = time.monotonic()
    with pytest.raises(BadRecordError) as e:
        process_record(rec, proc, max_frames=4, limits=MediaLimits(video_decode_timeout_s=0.3))
    assert time.monotonic() - t0 < 5
    assert e.value.category == "timeout" and "data.video_decode_timeout_s = 0.3 s" in str(e.value)


def test_stuck_decodes_are_bounded_per_process(decoder, clip, monkeypatch):
    monkeypatch.setattr(media, "MAX_ABANDONED_DECODES", 1)
    monkeypatch.setattr(media, "_abandoned", [])
    decoder.hang = "probe"
    limits = MediaLimits(video_decode_timeout_s=0.2)
    with pytest.raises(BadRecordError, match="no result within"):
        read_video({"video": str(clip)}, 4, 2.0, limits=limits)
    probes = decoder.probes
    with pytest.raises(BadRecordError, match="still hanging"):
        read_video({"video": str(clip)}, 4, 2.0, limits=limits)
    assert decoder.probes == probes  # not even started
    decoder.release.set()
    for _ in range(100):
        if not any(t.is_alive() for t in media._abandoned):
            break
        time.sleep(0.05)
    decoder.hang = None
    assert read_video({"video": str(clip)}, 4, 2.0, limits=limits).num_frames == 4


def test_decoder_errors_and_missing_backend_are_video_bad_records(clip, monkeypatch):
    class Broken(FakeDecoder):
        def decode(self, src, indices):
            raise RuntimeError("invalid data found when processing input")

    previous = set_video_decoder(Broken())
    try:
        with pytest.raises(BadRecordError, match="video: cannot read video file .*RuntimeError"):
            read_video({"video": str(clip)}, 4, 2.0)
    finally:
        set_video_decoder(previous)
    import builtins

    real_import = builtins.__import__

    def no_av(name, *a, **kw):
        if name == "av":
            raise ImportError("No module named 'av'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_av)
    previous = set_video_decoder(media.PyAVDecoder())
    try:
        with pytest.raises(BadRecordError, match="needs PyAV"):
            read_video({"video": str(clip)}, 4, 2.0, decode=False)
    finally:
        set_video_decoder(previous)


def test_hanging_video_in_the_sft_loader_is_counted_and_the_run_goes_on(proc, decoder, clip, tmp_path):
    decoder.hang = "decode"
    lines = [{"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]},
             {"messages": [{"role": "user", "content": [{"type": "video", "video": str(clip)},
                                                         {"type": "text", "text": "What happens?"}]},
                           {"role": "assistant", "content": "nothing"}]}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = DataConfig(type="messages_jsonl", train_path=str(path), num_workers=0, max_frames=4,
                     video_decode_timeout_s=0.3, max_tokens_per_pack=1024)
    loader = build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
    pack = next(iter(loader))
    assert int(pack["num_samples"]) == 1
    (bad,) = loader.bad_records.entries
    assert (bad.source, bad.index, bad.category) == (str(path), 2, "timeout")


class _StuckPacks:
    """A dataset whose every item hangs (module level: the worker server imports it to unpickle it)."""

    def __getitem__(self, key):
        time.sleep(60)


def test_a_stuck_dataloader_worker_stops_the_run_naming_the_key(proc, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Say hi."},
                                             {"role": "assistant", "content": "hi"}]}) + "\n")
    cfg = DataConfig(type="messages_jsonl", train_path=str(path), num_workers=1, video_decode_timeout_s=0.5,
                     loader_timeout_s=1.5)
    loader = build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
    loader.dataset = _StuckPacks()  # the worker processes get it pickled
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"data\.loader_timeout_s = 1.5 s"):
        next(iter(loader))
    assert time.monotonic() - t0 < 30
