"""The built-in environments `[rl.env] name` may give: "calculator" (a text tool) and "zoom" (a visual tool).

Both are `ToolEnvironment`s: the model calls the tool as often as it likes (up to `[rl.env]` max_turns) and
its first turn without a tool call is the final answer, scored by the `[[rl.rewards]]` verifiers.
"""
from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from megatron_vlm.rl.env.base import EnvSample, Observation
from megatron_vlm.rl.env.tools import ToolEnvironment, ToolRegistry

__all__ = ["calculate", "CalculatorEnv", "ZoomEnv"]

_OPS: dict[type, Callable[..., Any]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
        ast.UAdd: operator.pos}


# below Python's limit on printing an int (4300 digits), which `calculate` must do with its result
_MAX_DIGITS = 4000


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(right) > 64:
                raise ValueError("exponent too large")
            # nested powers stay under the exponent bound but not under the size: (((10**64)**64)**64)**64 has
            # 1.7e7 digits (a minute of CPU, past the turn deadline) and can never be printed
            if right > 0 and abs(left) > 1 and right * math.log10(abs(left)) > _MAX_DIGITS:
                raise ValueError(f"result too large (more than {_MAX_DIGITS} digits)")
        value = _OPS[type(node.op)](left, right)
        if isinstance(value, complex):  # a negative base to a fractional power: refused as math.pow refuses it
            raise ValueError(f"{left!r} ** {right!r} is not a real number")
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses)."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = _eval(ast.parse(expression, mode="eval"))
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


class CalculatorEnv(ToolEnvironment):
    """The `calculate` tool."""

    def __init__(self) -> None:
        super().__init__(registry=ToolRegistry([calculate]))


class ZoomEnv(ToolEnvironment):
    """The `zoom` tool on the prompt's first image: crop a box given in fractions of the image and show it
    enlarged `scale` times (so detail too small to read at the prompt's resolution becomes legible)."""

    def __init__(self, scale: int = 4, max_side: int = 112) -> None:
        self.scale, self.max_side = int(scale), int(max_side)

        def zoom(left: float, top: float, right: float, bottom: float) -> tuple[str, list]:
            """Show the part of the image inside the box (fractions 0..1 of its width and height), enlarged."""
            return self._zoom(left, top, right, bottom)

        super().__init__(registry=ToolRegistry([zoom]))

    def __getstate__(self) -> dict:  # the registry holds a closure: rebuilt on unpickling
        return {"scale": self.scale, "max_side": self.max_side, "sample": getattr(self, "sample", None)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["scale"], state["max_side"])  # type: ignore[misc]
        if state["sample"] is not None:
            self.sample = state["sample"]

    def reset(self, sample: EnvSample) -> Observation:
        if not sample.images:
            raise ValueError("zoom: the prompt has no image to zoom into")
        return super().reset(sample)

    def _zoom(self, left: float, top: float, right: float, bottom: float) -> tuple[str, list]:
        image = self.sample.images[0]
        w, h = image.size
        box = (int(max(0.0, left) * w), int(max(0.0, top) * h), int(min(1.0, right) * w), int(min(1.0, bottom) * h))
        if box[2] - box[0] < 2 or box[3] - box[1] < 2:
            raise ValueError("the box is empty; give left < right and top < bottom as fractions of the image")
        crop = image.crop(box)
        cw, ch = crop.size
        f = min(self.scale, self.max_side / max(cw, ch))
        crop = crop.resize((max(2, int(cw * f)), max(2, int(ch * f))))
        return f"Zoomed into {box}:", [crop]
