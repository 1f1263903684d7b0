"""The dataset's media limits apply to what an environment shows: `data.max_frames` subsamples a video's frames
uniformly (as a frame list in a record is, its timestamps kept), `data.max_image_pixels` / `data.max_video_pixels`
refuse an image / frame / video that is too large (a record's would be a bad record; the observation ends its
trajectory as env_error). Applied in the environment's worker before its reply is pickled: a huge image or a long
frame list used to travel between processes and through the processor before the token budget refused it."""
import pickle

import numpy as np
import pytest

from megatron_vlm.data.media import read_video
from megatron_vlm.rl.env.base import EnvSample
from megatron_vlm.rl.env.observation_limits import ObservationLimits
from megatron_vlm.rl.env.pool import EnvCall, InlineEnvRunner, build_environment
from megatron_vlm.rl.env.session import EnvSession
from megatron_vlm.rl.env.turns import TurnEncoder

FNS = "rl_env_fns_for_tests"


def _step(limits, **kwargs):
    """The reply of one step call as the worker sends it (its body: run_call, then pickled)."""
    env = build_environment(f"{FNS}:LongVideo", kwargs)
    env.reset(EnvSample(problem="q"))
    (reply,) = InlineEnvRunner().run([EnvCall("step", state=pickle.dumps(env), action="hi", limits=limits)])
    return reply


def test_a_long_video_is_subsampled_before_it_leaves_the_worker(proc):
    reply = _step(ObservationLimits(max_frames=4))
    assert not reply.error, reply.error
    (video,) = reply.result.observation.videos
    assert [int(f[0, 0, 0]) for f in video.frames] == [0, 13, 26, 39]  # 4 of the 40 frames crossed, not 40
    enc = TurnEncoder(proc)
    session = EnvSession(InlineEnvRunner(), enc, name=f"{FNS}:LongVideo", kwargs={}, samples=[EnvSample(problem="q")],
                         histories=[[{"role": "user", "content": "q"}]], n=1, eos_token_ids=[enc.turn_end_id],
                         limits=ObservationLimits(max_frames=4))
    (turn,) = session.step([(0, 0, "hello", [5, enc.turn_end_id], 4000)])
    assert not turn.error, turn.error
    (clip,) = turn.chunk.videos
    frames = [np.full((28, 28, 3), i, dtype=np.uint8) for i in range(40)]
    from PIL import Image

    record = read_video({"video": [Image.fromarray(f) for f in frames], "fps": 4.0}, 4, 2.0)  # a record's frame list
    assert (clip.indices, clip.total_frames, clip.timestamps, clip.effective_fps) == \
        (record.indices, record.total_frames, record.timestamps, record.effective_fps)


@pytest.mark.parametrize("limits, kwargs, key", [
    (ObservationLimits(max_image_pixels=28 * 28 - 1), {"frames": 2, "image": True}, "data.max_image_pixels"),
    (ObservationLimits(max_image_pixels=28 * 28 - 1), {"frames": 2}, "data.max_image_pixels"),  # a frame
    (ObservationLimits(max_frames=8, max_video_pixels=8 * 28 * 28 - 1), {}, "data.max_video_pixels"),
])
def test_too_large_media_are_refused_in_the_worker(limits, kwargs, key):
    reply = _step(limits, **kwargs)
    assert reply.result is None and key in reply.error and f"{FNS}:LongVideo" in reply.error, reply.error


def test_within_the_limits_nothing_changes():
    reply = _step(ObservationLimits(max_frames=40, max_image_pixels=28 * 28, max_video_pixels=40 * 28 * 28))
    assert not reply.error and len(reply.result.observation.videos[0]) == 40


def test_the_data_limits_reach_the_session(monkeypatch):
    """Both loops build the rounds with MultiTurnRounds.from_config(..., data=cfg.data)."""
    from types import SimpleNamespace as NS

    from megatron_vlm.rl.env import rollout as env_rollout
    from megatron_vlm.rl.env.config import RLEnvConfig

    built = {}
    monkeypatch.setattr(env_rollout.MultiTurnRounds, "__init__", lambda self, *a, **k: built.update(k))
    rl = NS(env=RLEnvConfig(name=f"{FNS}:Echo", sandbox=False), reward_pool=NS(workers=1, memory_limit_mb=0),
            rewards=["a verifier"])
    env_rollout.MultiTurnRounds.from_config(rl, 4096, engine=None, processor=None,
                                            data=NS(max_frames=3, max_image_pixels=100, max_video_pixels=300))
    assert built["limits"] == ObservationLimits(max_frames=3, max_image_pixels=100, max_video_pixels=300)
