"""A user's environment that returns the wrong thing gets an error naming the environment and what was wrong.

Written as a user coming from gym / TRL would (a dict or a bare string as the observation, one image instead of a
list, `reset` without its return): each such turn ends its trajectory as env_error (counted, the job goes on), and
its message, what the step's warning shows, names the environment's class and the bad value. A bare string as the
observation, one image outside a list or a number as the text used to surface as an internal error of the turn
encoder ("'str' object has no attribute 'parts'", "object of type 'Image' has no len()") naming neither."""
import pytest

from megatron_vlm.rl.env.base import EnvSample
from megatron_vlm.rl.env.pool import InlineEnvRunner
from megatron_vlm.rl.env.session import EnvSession
from megatron_vlm.rl.env.turns import TurnEncoder

FNS = "rl_env_fns_for_tests"


@pytest.mark.parametrize("name, why", [
    ("StepReturnsDict", "step returned dict, not a StepResult"),
    ("ObservationIsText", "observation of type str, not an Observation"),
    ("ImageNotInAList", "observation.images of type ndarray, not a list"),
    ("TextNotAString", "observation.text of type int, not a str"),
    ("ResetReturnsNothing", "reset returned NoneType, not an Observation"),
    ("RewardNotANumber", "reward of type str, not a number"),
])
def test_a_wrong_return_names_the_environment(proc, name, why):
    enc = TurnEncoder(proc)
    session = EnvSession(InlineEnvRunner(), enc, name=f"{FNS}:{name}", kwargs={}, samples=[EnvSample(problem="q")],
                         histories=[[{"role": "user", "content": "q"}]], n=1, eos_token_ids=[enc.turn_end_id])
    (reply,) = session.step([(0, 0, "hello", [5, enc.turn_end_id], 100)])
    assert reply.chunk is None and session.errors == 1
    assert f"{FNS}:{name}" in reply.error and why in reply.error, reply.error


def test_a_final_step_needs_no_observation(proc):
    enc = TurnEncoder(proc)
    session = EnvSession(InlineEnvRunner(), enc, name=f"{FNS}:DoneWithoutObservation", kwargs={},
                         samples=[EnvSample(problem="q")], histories=[[{"role": "user", "content": "q"}]], n=1,
                         eos_token_ids=[enc.turn_end_id])
    (reply,) = session.step([(0, 0, "hello", [5, enc.turn_end_id], 100)])
    assert reply.done and reply.reward == 1.0 and not reply.error and session.errors == 0


def test_tools_that_change_with_the_sample_are_refused(proc):
    """The tool specs go into every prompt's system turn before the rollout, from an environment built once (not
    reset): an environment whose `tools()` depends on its sample would talk to a model shown other tools. Its
    trajectories end as env_error saying so (reset's tools used to be dropped without a look); one whose tools match
    goes on."""
    enc = TurnEncoder(proc)
    samples = [EnvSample(problem="lookup the capital"), EnvSample(problem="2 + 2")]
    session = EnvSession(InlineEnvRunner(), enc, name=f"{FNS}:ToolsOfTheSample", kwargs={}, samples=samples,
                         histories=[[{"role": "user", "content": s.problem}] for s in samples], n=1,
                         eos_token_ids=[enc.turn_end_id], tools=[])
    replies = session.step([(0, 0, "hi", [5, enc.turn_end_id], 100), (1, 1, "hi", [5, enc.turn_end_id], 100)])
    assert "tools" in replies[0].error and "per-sample tools" in replies[0].error, replies[0].error
    assert replies[1].done and not replies[1].error and session.errors == 1


@pytest.mark.parametrize("name, images, videos", [("StackedImages", 2, 0), ("VideoAsArray", 0, 1)])
def test_arrays_of_images_and_frames_are_taken(proc, name, images, videos):
    """A stack of images as one N x H x W x 3 array, a video as one T x H x W x 3 array: sequences as lists are."""
    enc = TurnEncoder(proc)
    session = EnvSession(InlineEnvRunner(), enc, name=f"{FNS}:{name}", kwargs={}, samples=[EnvSample(problem="q")],
                         histories=[[{"role": "user", "content": "q"}]], n=1, eos_token_ids=[enc.turn_end_id])
    (reply,) = session.step([(0, 0, "hello", [5, enc.turn_end_id], 1000)])
    assert not reply.error and (len(reply.chunk.images), len(reply.chunk.videos)) == (images, videos), reply.error


@pytest.mark.parametrize("fps", [0.0, -2.0, float("nan"), float("inf"), "2"])
def test_a_video_rate_that_is_no_rate_is_refused(proc, fps):
    """The frames' rate sets the video's M-RoPE time positions (Qwen-VL: second_per_grid_ts = 2 / fps): a negative,
    NaN or infinite rate gave -1, NaN or 0 there, a silent garbage of positions, and 0 an unexplained
    ZeroDivisionError. Such a turn now ends its trajectory naming video_fps; 2.0 goes on."""
    enc = TurnEncoder(proc)

    def reply(rate):
        session = EnvSession(InlineEnvRunner(), enc, name=f"{FNS}:VideoAtRate", kwargs={"fps": rate},
                             samples=[EnvSample(problem="q")], histories=[[{"role": "user", "content": "q"}]], n=1,
                             eos_token_ids=[enc.turn_end_id])
        return session.step([(0, 0, "hello", [5, enc.turn_end_id], 1000)])[0]

    bad = reply(fps)
    assert bad.chunk is None and f"{FNS}:VideoAtRate" in bad.error and "video_fps" in bad.error, bad.error
    good = reply(2.0)
    assert not good.error and float(good.chunk.vision["second_per_grid_ts"][0]) == 1.0
