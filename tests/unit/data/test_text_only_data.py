"""Text-only data for the text models: the synthetic arithmetic tables, the `TextProcessor` a tokenizer-only
folder gets, SFT records from messages JSONL and from a prompt / answer parquet (no pixel keys, labels
on the answer), GRPO prompts from the same parquet, and the rollout engine on a text model (1-D RoPE
KV-cache decoding whose behaviour log-probs equal the packed training forward's)."""
import json

import pytest
import torch

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.data.batch import VISION_KEYS
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.processing import process_record
from megatron_vlm.data.processor import load_processor
from megatron_vlm.data.processor_text import TextProcessor
from megatron_vlm.data.sources import open_split
from megatron_vlm.data.synthetic_arith import arith_rows, write_synthetic_arith
from megatron_vlm.inference.engine import SamplingParams
from megatron_vlm.inference.policy_engine import PolicyRolloutEngine
from megatron_vlm.rl.batching import TrainSample, pack_samples
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
from megatron_vlm.rl.prompts.encoder import PromptEncoder
from megatron_vlm.testing.synthesize import synthesize_model_folder
from megatron_vlm.training.lm_loss import TokenLogprobModel

COLUMNS = {"prompt": "question", "answer": "answer"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return synthesize_model_folder("tiny_qwen2", tmp_path_factory.mktemp("m") / "tiny_qwen2", seed=0)


@pytest.fixture(scope="module")
def arith(tmp_path_factory):
    return write_synthetic_arith(tmp_path_factory.mktemp("arith"), max_operand=9, eval_size=20, seed=3)


def test_arith_splits_are_disjoint_correct_and_deterministic():
    train, evals = arith_rows(9, 20, seed=3)
    assert len(train) == 80 and len(evals) == 20
    assert not {r["question"] for r in train} & {r["question"] for r in evals}
    for r in train + evals:
        a, b = (int(x) for x in r["question"][len("What is "):-1].split(" + "))
        assert r["answer"] == str(a + b)
    assert (train, evals) == arith_rows(9, 20, seed=3) and evals != arith_rows(9, 20, seed=4)[1]


def test_tokenizer_only_folder_gets_the_text_processor(folder, tmp_path):
    proc = load_processor(folder)
    assert isinstance(proc, TextProcessor) and proc.image_token is None and proc.image_token_id is None
    with pytest.raises(ValueError, match="pixel limits"):
        load_processor(folder, max_pixels=1000)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {}}))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="preprocessor_config"):
        load_processor(tmp_path)


def test_sft_records_from_messages_and_from_a_prompt_answer_table(folder, arith, tmp_path):
    proc = load_processor(folder)
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text(json.dumps({"messages": [{"role": "user", "content": "What is 2 + 3?"},
                                              {"role": "assistant", "content": "5"}]}) + "\n")
    for cfg in (DataConfig(type="messages_jsonl", train_path=str(jsonl)),
                DataConfig(type="hf", train_path=str(arith["train"]), columns=COLUMNS)):
        source = open_split(cfg, "train")
        sample = process_record(source.get(0), proc, max_frames=4)
        assert all(getattr(sample, k, None) is None for k in VISION_KEYS)
        labelled = proc.tokenizer.decode(sample.input_ids[sample.label_mask])
        assert labelled.endswith("<|im_end|>") and labelled[:-len("<|im_end|>")].isdigit()


def test_a_record_with_an_image_is_a_bad_record_for_a_text_model(folder):
    from megatron_vlm.data.messages import Record

    rec = Record(messages=[{"role": "user", "content": [{"type": "image", "image": "x.png"}, {"type": "text", "text": "hi"}]},
                           {"role": "assistant", "content": "5"}], source="t", index=0)
    with pytest.raises(BadRecordError, match="placeholder"):
        process_record(rec, load_processor(folder), max_frames=4)


def test_grpo_prompts_and_rollout_on_a_text_model(folder, arith):
    model, proc = load_hf_model(folder).eval(), load_processor(folder)
    dataset = load_prompt_dataset(arith["eval"], columns=COLUMNS)
    encoder = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=4, max_tokens=256)
    prompts = [encoder.encode(s) for s in dataset.samples[:3]]
    assert all(p is not None and all(getattr(p, k) is None for k in VISION_KEYS) for p in prompts)
    assert dataset.samples[0].answer == arith_rows(9, 20, seed=3)[1][0]["answer"]
    res = PolicyRolloutEngine(model, proc.tokenizer).generate(
        prompts, SamplingParams(max_new_tokens=4, n=2, temperature=1.0), generator=torch.Generator().manual_seed(0))
    assert len(res.samples) == 6
    samples = [TrainSample(prompt=prompts[s.prompt_index], response_ids=s.token_ids, behav_logp=s.logprobs, advantage=0.0)
               for s in res.samples]
    batch = pack_samples(samples)
    batch.pop("num_response_tokens")
    with torch.no_grad():
        recomputed = TokenLogprobModel(model)(batch)
    torch.testing.assert_close(recomputed, torch.cat([s.behav_logp for s in samples]), atol=1e-4, rtol=0)
