"""Model outputs are untrusted: code-injection payloads go through every built-in verifier — as the
completion, inside \\boxed{}, "final answer" phrases, answer tags, sets, and as the reference — and
must not run. Checked three ways: the marker file a payload would create does not appear (in
process and through the reward worker pool), Python's eval / exec are never called during
verification, and the rewards package source contains no eval-based parser call."""
import builtins
import pathlib
import re

import pytest

from megatron_vlm.rl.rewards.pool import RewardCall, RewardWorkerPool
from megatron_vlm.rl.rewards.verifiers import BUILTIN_VERIFIERS
from tests.unit.rl.math_reward_corpus import CASES

REWARDS_DIR = pathlib.Path(__import__("megatron_vlm.rl.rewards", fromlist=["x"]).__file__).parent


def _payloads(marker: pathlib.Path) -> list[str]:
    m = str(marker)
    code = [
        f"__import__('os').system('touch {m}')",
        f'__import__("os").system("touch {m}")',
        f"exec(\"import os; os.system('touch {m}')\")",
        f"eval(compile('import os\\nos.system(\"touch {m}\")', 'x', 'exec'))",
        f"(lambda: __import__('subprocess').call(['touch', '{m}']))()",
        f"open('{m}', 'w').write('x')",
        f"getattr(__builtins__, '__import__')('os').system('touch {m}')",
        f"[c for c in ().__class__.__base__.__subclasses__()] or open('{m}','w')",
        f"Symbol('x') + __import__('os').system('touch {m}')",
        f"x = __import__('os').system('touch {m}')",
    ]
    wrapped = []
    for c in code:
        wrapped += [
            c,
            f"\\boxed{{{c}}}",
            f"<think>pwn</think> The final answer is {c}.",
            f"Answer: {c}",
            f"\\boxed{{\\text{{{c}}}}}",
            f"\\boxed{{\\{{{c}\\}}}}",
            f"<answer>{c}</answer>",
            f"$\\frac{{{c}}}{{2}}$ so \\boxed{{\\sqrt{{{c}}}}}",
        ]
    return wrapped


@pytest.fixture
def no_eval(monkeypatch):
    """Record any eval / exec call made while verifying."""
    seen = []
    real_eval, real_exec = builtins.eval, builtins.exec

    def spy_eval(src, *a, **k):
        seen.append(("eval", str(src)[:80]))
        return real_eval(src, *a, **k)

    def spy_exec(src, *a, **k):
        seen.append(("exec", str(src)[:80]))
        return real_exec(src, *a, **k)

    monkeypatch.setattr(builtins, "eval", spy_eval)
    monkeypatch.setattr(builtins, "exec", spy_exec)
    return seen


def test_payloads_do_not_run_in_process(tmp_path, no_eval):
    marker = tmp_path / "pwned"
    payloads = _payloads(marker)
    options = {"answer_tag": "answer", "fallback_last_number": True}
    for text in payloads:
        for name, fn in BUILTIN_VERIFIERS.items():
            kw = options if name == "math" else {}
            v1 = fn(text, "0", prompt=text, **kw)  # payload as completion (and prompt)
            v2 = fn("\\boxed{0}", text, **kw)  # payload as the reference answer
            assert v1 in (0.0, 1.0) and v2 in (0.0, 1.0)
    assert not marker.exists()
    assert no_eval == []


def test_payloads_do_not_run_through_the_pool(tmp_path):
    marker = tmp_path / "pwned_pool"
    payloads = _payloads(marker)
    calls = [RewardCall(name, text, "0", prompt=text) for text in payloads for name in BUILTIN_VERIFIERS]
    calls += [RewardCall("math", "\\boxed{0}", text) for text in payloads]
    with RewardWorkerPool(num_workers=2, timeout_s=10.0) as pool:
        res = pool.map(calls)
    assert not marker.exists()
    assert all(r.status == "ok" for r in res), [r for r in res if r.status != "ok"][:3]
    # same verdicts as in process; only the format verifier may accept a well-formed payload
    expected = [BUILTIN_VERIFIERS[c.verifier](c.completion, c.answer, prompt=c.prompt) for c in calls]
    assert [r.value for r in res] == expected
    assert all(r.value == 0.0 for r, c in zip(res, calls) if c.verifier != "format")


def test_rewards_source_has_no_eval_based_parsing():
    # the builtins eval / exec, not a method of that name (a reward model's `module.eval()`)
    forbidden = re.compile(r"\b(sympify|parse_expr|parse_latex_lark|latex2sympy)\s*\(|(?<![.\w])(eval|exec)\s*\("
                           r"|import\s+math_verify|from\s+math_verify")
    offenders = []
    for path in REWARDS_DIR.rglob("*.py"):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if forbidden.search(code) and not code.strip().startswith(('"', "'")):
                offenders.append(f"{path.name}:{i}: {line.strip()}")
    assert offenders == []


def test_sympy_text_parsers_are_never_reached(tmp_path, monkeypatch, no_eval):
    """sympy's string parsers (`parse_expr`, and `sympify` on a string, which goes through it) run
    Python `eval`: make them raise, then verify the payloads and the whole answer corpus — nothing may
    reach them (our parser builds sympy objects directly)."""
    import sympy.parsing.sympy_parser as sp

    calls = []

    def forbidden(*args, **kwargs):
        calls.append(str(args[0])[:80] if args else "")
        raise AssertionError("a sympy text parser was called")

    monkeypatch.setattr(sp, "parse_expr", forbidden)
    monkeypatch.setattr(sp, "eval_expr", forbidden)
    math = BUILTIN_VERIFIERS["math"]
    for text in _payloads(tmp_path / "pwned_sympy"):
        math(text, "0")
        math("\\boxed{0}", text)
    for _, completion, gold, _ in CASES:
        math(completion, gold)
    assert calls == []
    # allowed: exec of compiled module code (the import system loading sympy submodules on first use)
    # and sympy.polys' monomial functions, generated from sympy's fixed templates (no input text)
    assert [c for c in no_eval if not c[1].startswith(("<code object", "def monomial_"))] == []
