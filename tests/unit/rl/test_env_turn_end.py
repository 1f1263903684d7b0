"""A model turn closes its chat turn only when its last token is the template's end-of-turn token (`<|im_end|>`):
then the appended environment turn starts after it. A turn that ended on another EOS id (Qwen's `<|endoftext|>`, in
every Qwen2.5 / Qwen3 generation config's eos list) did not write `<|im_end|>`, so the environment turn must start
with it; the session used to tell the turn encoder "ended with EOS" for any EOS id, and the conversation then went
on with the model's turn never closed (`...answer<|endoftext|>\\n<|im_start|>user...`)."""
from megatron_vlm.inference.multiturn import TurnChunk
from megatron_vlm.rl.env.base import EnvSample
from megatron_vlm.rl.env.pool import InlineEnvRunner
from megatron_vlm.rl.env.session import EnvSession

IM_END, ENDOFTEXT, OTHER = 962, 960, 7
FNS = "rl_env_fns_for_tests"


class RecordingEncoder:
    """Records the `ended_with_eos` each turn is encoded with (the token ids of the tiny tokenizer's specials)."""

    turn_end_id = IM_END

    def __init__(self):
        self.closed: list[bool] = []

    def encode(self, history, turn_text, ended_with_eos, obs):
        import torch

        self.closed.append(ended_with_eos)
        return TurnChunk(torch.tensor([1, 2])), history


def test_only_the_turn_end_token_closes_the_turn():
    enc = RecordingEncoder()
    session = EnvSession(InlineEnvRunner(), enc, name=f"{FNS}:Echo", kwargs={}, samples=[EnvSample(problem="q")],
                         histories=[[]], n=4, eos_token_ids=[IM_END, ENDOFTEXT])
    replies = session.step([(0, 0, "a", [5, IM_END]), (1, 0, "a", [5, ENDOFTEXT]), (2, 0, "a", [5, OTHER]),
                            (3, 0, "", [])])
    assert all(r.chunk is not None and not r.error for r in replies)
    assert enc.closed == [True, False, False, False]
