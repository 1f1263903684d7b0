"""The zoom demo's data: the dot's colour is the answer, it is (nearly) gone at the processor's 112 px, the SFT
traces hold the conversation the `zoom` environment holds (its system turn, a parseable call, the crop it returns)."""
from __future__ import annotations

import json
from collections import Counter

from PIL import Image

from megatron_vlm.data.messages import normalize_messages
from megatron_vlm.rl.env.base import EnvSample
from megatron_vlm.rl.env.builtin import ZoomEnv
from megatron_vlm.rl.env.tool_calls import ToolCall, parse_tool_calls
from megatron_vlm.rl.env.turns import tools_system_text
from megatron_vlm.rl.env.zoom_data import QUESTION, ZOOM_BOX, ZOOM_COLOURS, write_synthetic_zoom


def test_files_traces_and_the_dot(tmp_path):
    paths = write_synthetic_zoom(tmp_path, n_train=5, n_eval=6, n_test=3, seed=1, spec_every=2)
    tool = [json.loads(x) for x in paths["sft_tool"].read_text().splitlines()]
    direct = [json.loads(x) for x in paths["sft_direct"].read_text().splitlines()]
    evals = [json.loads(x) for x in paths["eval"].read_text().splitlines()]
    assert len(tool) == len(direct) == 5 and len(evals) == 6
    assert len(paths["test"].read_text().splitlines()) == 3
    assert Counter(r["answer"] for r in evals) == Counter(list(ZOOM_COLOURS) * 2)  # balanced: each of 3 twice
    for i, (t, d) in enumerate(zip(tool, direct)):
        msgs = normalize_messages(t["messages"])
        if i % 2 == 0:  # every spec_every-th trace carries the tool specs, the others the same turns without them
            assert msgs[0]["content"] == tools_system_text(ZoomEnv().tools())
            msgs = msgs[1:]
        assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
        assert d["messages"] == t["messages"][-4:-3] + [{"role": "assistant", "content": d["answer"]}]
        assert d["messages"][0]["content"][1]["text"] == QUESTION
        (call,) = parse_tool_calls(msgs[1]["content"])
        assert isinstance(call, ToolCall) and call.name == "zoom" and call.arguments == ZOOM_BOX
        image = Image.open(tmp_path / d["messages"][0]["content"][0]["image"]).convert("RGB")
        assert image.size == (448, 448)
        assert image.getpixel((224, 224)) == ZOOM_COLOURS[t["answer"]] == ZOOM_COLOURS[msgs[3]["content"]]
        env = ZoomEnv()
        env.reset(EnvSample(problem=QUESTION, answer=t["answer"], images=[image]))
        text, (crop,) = env._zoom(**ZOOM_BOX)
        assert msgs[2]["content"][1]["text"] == text
        shown = Image.open(tmp_path / msgs[2]["content"][0]["image"]).convert("RGB")
        assert shown.tobytes() == crop.tobytes()
        # the crop is mostly the dot; the 112 px view the processor makes keeps little of it
        rgb = ZOOM_COLOURS[t["answer"]]
        def share(img):  # of the pixels within 40 of the dot's colour in every channel
            return sum(max(abs(a - b) for a, b in zip(p, rgb)) < 40 for p in img.getdata()) / (img.width * img.height)

        in_crop, in_small = share(crop), share(image.resize((112, 112), Image.BICUBIC))
        assert in_crop > 0.5 and in_small < 0.01
