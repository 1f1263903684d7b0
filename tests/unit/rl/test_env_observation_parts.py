"""An observation of several turns (`Observation.parts`) places its images / videos by each part's counts; counts
that do not add up to the images and videos it holds are a ValueError saying so (the trajectory then ends as
env_error with that message), whether they ask for more than there are or leave some out. Asking for more raised a
bare StopIteration: the error the user saw was "observation: StopIteration: "."""
from __future__ import annotations

import pytest
from PIL import Image

from megatron_vlm.rl.env.base import Observation
from megatron_vlm.rl.env.turns import observation_messages

IMAGE = Image.new("RGB", (8, 8))


@pytest.mark.parametrize("obs, want", [
    (Observation(images=[IMAGE], parts=[{"role": "tool", "text": "a", "images": 2}]), "2 images for 1"),
    (Observation(images=[IMAGE], parts=[{"role": "tool", "text": "a", "images": 1},
                                        {"role": "tool", "text": "b", "images": 1}]), "2 images for 1"),
    (Observation(parts=[{"role": "tool", "text": "a", "videos": 1}]), "1 videos for 0"),
    (Observation(images=[IMAGE, IMAGE], parts=[{"role": "tool", "text": "a", "images": 1}]), "1 images for 2"),
])
def test_part_counts_that_do_not_add_up_are_named(obs, want):
    with pytest.raises(ValueError, match=want):
        observation_messages(obs)


def test_parts_that_add_up_place_each_image_before_its_text():
    obs = Observation(images=[IMAGE, IMAGE], parts=[{"role": "tool", "text": "a", "images": 1},
                                                    {"role": "tool", "text": "b", "images": 1}])
    out = observation_messages(obs)
    assert [[it["type"] for it in m["content"]] for m in out] == [["image", "text"], ["image", "text"]]
