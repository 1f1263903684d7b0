"""The environment written out in docs/environments.md is under 40 lines and works as the page says: built by
dotted path, a zoom call answered with an enlarged crop as a tool turn, the answer turn scored and done."""
import re
import sys
from pathlib import Path

from PIL import Image

from megatron_vlm.rl.env.base import EnvSample
from megatron_vlm.rl.env.pool import EnvCall, InlineEnvRunner, build_environment

DOC = Path(__file__).resolve().parents[3] / "docs" / "environments.md"


def test_the_documented_environment(tmp_path, monkeypatch):
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    assert len(code.strip().splitlines()) < 40
    (tmp_path / "my_envs.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_envs", None)
    env = build_environment("my_envs:ZoomThenAnswer")
    image = Image.new("RGB", (40, 20), (10, 20, 30))
    env.reset(EnvSample(problem="what colour", answer="blue", images=[image]))
    assert env.tools()[0]["function"]["name"] == "zoom"
    res = env.step('<tool_call>{"name": "zoom", "arguments": {"left": 0, "top": 0, "right": 0.5, "bottom": 0.5}}'
                   '</tool_call>')
    assert not res.done and res.observation.role == "tool" and res.observation.images[0].size == (80, 40)
    final = env.step("It is blue.")
    assert final.done and final.reward == 1.0
    # and through the runner (the pickled state round trip of the worker pool)
    (reset,) = InlineEnvRunner().run([EnvCall("reset", name="my_envs:ZoomThenAnswer",
                                              sample=EnvSample(problem="", answer="red", images=[image]))])
    (step,) = InlineEnvRunner().run([EnvCall("step", state=reset.state, action="red")])
    assert not step.error and step.result.done and step.result.reward == 1.0
