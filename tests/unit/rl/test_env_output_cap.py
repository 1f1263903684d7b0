"""A huge environment output is cut by characters before it is tokenized: a tool returning megabytes of text used to
be rendered and tokenized in full (minutes and gigabytes for tens of MB) only for the turn to be refused by the
token budget. The cut is (room + 1) x the most characters one token can cover, so text that would fit is never
cut (and a cut text that turns out to fit is encoded whole after all); the cut is counted
(env/observation_truncated), and the turn still ends the trajectory at max_total_tokens as before."""
import pytest
from multiturn_helpers import rollout, vqa_file

from megatron_vlm.rl.env.base import EnvSample, Observation
from megatron_vlm.rl.env.pool import InlineEnvRunner
from megatron_vlm.rl.env.session import EnvSession
from megatron_vlm.rl.env.trajectories import trajectory_metrics
from megatron_vlm.rl.env.turns import TurnEncoder

FNS = "rl_env_fns_for_tests"
HUGE = "many words of tool output 12345 " * 40_000  # 1.3 M characters


@pytest.fixture
def seen(proc, monkeypatch):
    """The lengths of all texts the tokenizer is called on."""
    lengths: list[int] = []
    cls = type(proc.tokenizer)
    real = cls.__call__

    def spy(self, text=None, *a, **kw):
        lengths.append(len(text) if isinstance(text, str) else -1)
        return real(self, text, *a, **kw)

    monkeypatch.setattr(cls, "__call__", spy)
    return lengths


def _session(proc, text):
    im_end = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    session = EnvSession(InlineEnvRunner(), TurnEncoder(proc), name=f"{FNS}:Echo", kwargs={"text": text},
                         samples=[EnvSample(problem="q")], histories=[[{"role": "user", "content": "q"}]], n=1,
                         eos_token_ids=[im_end])
    return session, im_end


def test_huge_output_is_cut_before_tokenizing_and_counted(proc, seen):
    session, im_end = _session(proc, HUGE)
    room = 200
    (reply,) = session.step([(0, 0, "a", [5, im_end], room)])
    assert not reply.error and reply.chunk is not None
    assert reply.chunk.input_ids.numel() > room  # still refused by the engine: max_total_tokens, as before
    assert reply.info["observation_truncated"] == 1.0
    cap = (room + 1) * session.encoder.max_chars_per_token
    assert cap < len(HUGE) // 4 and max(seen) <= cap + 200  # the cut text and the template around it
    assert trajectory_metrics([_traj(reply.info)])["env/observation_truncated"] == 1.0


def test_output_under_the_cap_keeps_its_exact_tokens(proc):
    text = HUGE[:3000]
    session, im_end = _session(proc, text)
    (capped,) = session.step([(0, 0, "a", [5, im_end], 10_000)])
    session, _ = _session(proc, text)
    (whole,) = session.step([(0, 0, "a", [5, im_end])])  # no room given: never cut
    chunk, _ = TurnEncoder(proc).encode([{"role": "user", "content": "q"}], "a", True, Observation(text=text))
    assert capped.chunk.input_ids.tolist() == whole.chunk.input_ids.tolist() == chunk.input_ids.tolist()
    assert "observation_truncated" not in capped.info


def test_a_cut_that_would_have_fit_is_undone(proc, monkeypatch):
    """Should the bound ever be too tight (a cut text that fits), the whole text is encoded: nothing that fits is cut."""
    text = "go on " * 50
    session, im_end = _session(proc, text)
    monkeypatch.setattr(TurnEncoder, "max_chars_per_token", 1)
    (reply,) = session.step([(0, 0, "a", [5, im_end], 150)])
    chunk, _ = TurnEncoder(proc).encode([{"role": "user", "content": "q"}], "a", True, Observation(text=text))
    assert reply.chunk.input_ids.tolist() == chunk.input_ids.tolist() and "observation_truncated" not in reply.info


def _traj(info):
    import torch

    from megatron_vlm.inference.multiturn import Trajectory

    return Trajectory(0, 0, torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool), torch.zeros(1), {},
                      "", ["a"], [0.0], "max_total_tokens", 1, info=dict(info))


@pytest.fixture(scope="module")
def vqa(tmp_path_factory):
    return vqa_file(tmp_path_factory.mktemp("vqa"))


def test_the_engine_gives_the_room_and_ends_at_max_total_tokens(vqa, tmp_path, proc, seen):
    _, _, trajs, session = rollout("tiny_qwen2_5_vl", vqa, tmp_path, env=f"{FNS}:Echo", kwargs={"text": HUGE},
                                   max_turns=3, max_total=400, n=1)
    assert session.errors == 0 and [t.finish_reason for t in trajs] == ["max_total_tokens"] * 2
    assert all(t.info["observation_truncated"] == 1.0 for t in trajs)
    assert max(seen) < len(HUGE) // 4
