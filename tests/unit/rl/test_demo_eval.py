"""The tool demos' held-out evaluation: greedy conversations through the multi-turn loop, with the tool's specs
in the system turn (tool arm) or one turn without them (no-tool arm), scored by the answers the data wrote."""
from __future__ import annotations

import pytest

from megatron_vlm.rl.env.calculator_data import write_synthetic_calculator
from megatron_vlm.rl.env.demo_eval import _score, evaluate_tool_demo
from megatron_vlm.testing.synthesize import synthesize_model_folder

COLUMNS = {"prompt": "question", "answer": "answer"}


def test_scores():
    assert _score("math", "4674", "4674") == 1.0 and _score("math", "so 4675", "4674") == 0.0
    assert _score("exact", " Red.", "red") == 1.0 and _score("exact", "red dot", "red") == 0.0


@pytest.mark.heavy  # ~65 s on the loaded CI machine (model load, two rollouts of 400-token prompts)
def test_both_arms_run_on_held_out_prompts(tmp_path):
    model = synthesize_model_folder("tiny_qwen2", tmp_path / "model", seed=0)
    paths = write_synthetic_calculator(tmp_path / "data", low=10, high=13, eval_size=2, test_size=3)
    tool = evaluate_tool_demo(model, paths["test"], env="calculator", columns=COLUMNS, max_new_tokens=6, max_turns=2)
    bare = evaluate_tool_demo(model, paths["test"], columns=COLUMNS, max_new_tokens=6)
    for out in (tool, bare):
        assert out["n"] == 3 and out["skipped"] == 0 and out["env_errors"] == 0
        assert 0.0 <= out["accuracy"] <= 1.0 and sum(out["finish"].values()) == 3
    assert bare["turns_mean"] == 1.0 and bare["tool_calls"] == 0
    assert 1.0 <= tool["turns_mean"] <= 2.0


def test_cli_names_a_prompt_file_it_cannot_read(tmp_path, capsys):
    """The docs' command without --columns on the calculator's question / answer table: one error line naming
    the columns it found, exit 2, before any model is loaded (the model folder here does not exist)."""
    from megatron_vlm.rl.env.demo_eval import main

    paths = write_synthetic_calculator(tmp_path / "data", low=10, high=12, eval_size=2, test_size=2)
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "no_model"), str(paths["test"]), "--env", "calculator"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "\nerror: prompts:" in "\n" + err and "['answer', 'question']" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "no_model"), str(paths["test"]), "--columns", "{prompt: question}"])
    assert e.value.code == 2 and "--columns" in capsys.readouterr().err
