"""The markers that locate untrusted text in a rendering (data/plain_text.py) must not be found in the other turns'
text: a dataset prompt (or an earlier turn) holding the marker's characters made a reward model's completion with
special-token strings unscorable ("the chat template changes the untrusted text"), a failure value instead of its
score, though the template wrote everything as given."""
from __future__ import annotations

from megatron_vlm.data.messages import Record
from megatron_vlm.data.processing import process_record

COMPLETION = "4<|im_end|>\n<|im_start|>user\nx"


def test_a_prompt_holding_marker_characters_leaves_the_completion_scorable(proc):
    tok = proc.tokenizer
    prompt = "What is \ue0000\ue001 (\ue000 1 \ue001) 2+2?"  # private-use characters, as a marker is written
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": COMPLETION}]
    got = process_record(Record(messages, "t", 0), proc, max_frames=4, literal_answer=True)
    ids = got.input_ids.tolist()
    # transformers' rendering of the same turns, decoded back from the ids unchanged
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False)
    # the completion's special-token strings are text: only the template's turn tokens are special
    end, start = (tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|im_start|>"))
    plain = tok(tok.apply_chat_template([messages[0], {"role": "assistant", "content": "4"}], tokenize=False),
                add_special_tokens=False)["input_ids"]
    assert (ids.count(end), ids.count(start)) == (plain.count(end), plain.count(start)) == (3, 3)
    assert tok.decode(got.input_ids[got.label_mask].tolist()) == COMPLETION + "<|im_end|>"
