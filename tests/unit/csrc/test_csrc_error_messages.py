"""The compiled ops' own error messages (torch.ops.megatron_vlm.*, not the Python fallbacks), above all those that
put numbers, dtypes and shapes into their text: csrc/check.h builds them without iostreams (an ostream inserting an
integer crashed these paths on a CUDA machine), and the text must be what the TORCH_CHECK* formatting gave (an
ostream's defaults: integers in decimal, floating point as "%g", dtypes by name, sizes as "[a, b, c]").

Every check macro kind the extension uses is exercised: MVLM_CHECK_VALUE (ValueError) and MVLM_CHECK_INDEX
(IndexError). The expected strings are written out here from the messages' wording, not read back from the op.
"""
import pytest
import torch

IMAGE, VIDEO = 151655, 151656


@pytest.fixture
def ops(ext):
    return torch.ops.megatron_vlm


def _raises(exc_type, fn, *args):
    with pytest.raises(exc_type) as info:
        fn(*args)
    assert type(info.value) is exc_type
    return str(info.value)


def _attention_inputs(tq, heads=2, d=16):
    q, k, v = (torch.randn(tq, heads, d) for _ in range(3))
    return q, k, v


def test_cu_seqlens_that_miss_the_token_counts_name_them(ops):
    # the error path of the reported SIGSEGV (samples_of formatting two int64 values)
    q, k, v = _attention_inputs(15)
    cu = torch.tensor([0, 6, 14], dtype=torch.int32)
    msg = _raises(ValueError, ops.varlen_attention_fwd, q, k, v, cu, cu, True, 0.25)
    assert msg == "attention: cu_seqlens must start at 0, not decrease and end at the token counts (q 15, k 15)"
    qk = _attention_inputs(7)[0]
    msg = _raises(ValueError, ops.varlen_attention_fwd, qk, k, v, torch.tensor([0, 7]), torch.tensor([0, 7]), True, 1.0)
    assert msg == "attention: cu_seqlens must start at 0, not decrease and end at the token counts (q 7, k 15)"


def test_decreasing_cu_seqlens(ops):
    q, k, v = _attention_inputs(15)
    bad = torch.tensor([0, 9, 6, 15], dtype=torch.int32)
    msg = _raises(ValueError, ops.varlen_attention_fwd, q, k, v, bad, bad, True, 0.25)
    assert msg == "attention: cu_seqlens must start at 0, not decrease and end at the token counts"


def test_attention_head_dim_names_the_limit(ops):
    q, k, v = _attention_inputs(4, d=12)
    cu = torch.tensor([0, 4])
    msg = _raises(ValueError, ops.varlen_attention_fwd, q, k, v, cu, cu, False, 1.0)
    assert msg == "attention (csrc): head dim must be a multiple of 8 and <= 512"


def test_out_of_range_cache_block_names_the_sequence_block_and_count(ops):
    q = torch.randn(2, 2, 8)
    kc = vc = torch.randn(3, 4, 1, 8)
    seqlens, table = torch.tensor([5, 2]), torch.tensor([[0, 7], [1, 0]])
    msg = _raises(IndexError, ops.decode_attention, q, kc, vc, seqlens, None, table, 8, 1.0)
    assert msg == "decode_attention: sequence 0 reads cache block / slot 7 of 3"
    table = torch.tensor([[0, 1], [-2, 0]])
    msg = _raises(IndexError, ops.decode_attention, q, kc, vc, seqlens, None, table, 8, 1.0)
    assert msg == "decode_attention: sequence 1 reads cache block / slot -2 of 3"


@pytest.mark.parametrize("value", [3, -1, 2**40])
def test_mm_token_type_ids_value(ops, value):
    ids = torch.tensor([[1, 2, 3]])
    types = torch.full_like(ids, value)
    msg = _raises(ValueError, ops.mrope_position_ids, ids, types, None, None, None, None, None, 1.0, IMAGE, VIDEO, 2)
    assert msg == f"mm_token_type_ids has value {value}; expected 0, 1 or 2"


def test_bad_grid_names_its_argument(ops):
    ids = torch.tensor([[1, 2, 3]])
    msg = _raises(ValueError, ops.mrope_position_ids, ids, None, None, None, torch.zeros(2, 4, dtype=torch.long), None,
                  None, 1.0, IMAGE, VIDEO, 2)
    assert msg == "image_grid_thw must be [n, 3]"


def test_label_outside_the_vocabulary(ops):
    z = torch.randn(4, 10)
    msg = _raises(IndexError, ops.token_logprob_rows, z, torch.tensor([0, 1, 10, 2]), False)
    assert msg == "token log-probs (csrc): label 10 outside [0, 10)"
    msg = _raises(IndexError, ops.token_logprob_rows, z, torch.tensor([0, -3, 1, 2]), True)
    assert msg == "token log-probs (csrc): label -3 outside [0, 10)"


def test_sampler_messages_with_dtypes_shapes_and_floats(ops):
    logits = torch.randn(3, 5)
    msg = _raises(ValueError, ops.sample_rows, logits.double(), torch.rand(3), None, 1.0)
    assert msg == "sample_rows: logits must be contiguous float32 [rows, vocab], got Double [3, 5]"
    msg = _raises(ValueError, ops.sample_rows, torch.randn(2, 3, 5), torch.rand(3), None, 1.0)
    assert msg == "sample_rows: logits must be contiguous float32 [rows, vocab], got Float [2, 3, 5]"
    msg = _raises(ValueError, ops.sample_rows, logits, torch.rand(2, dtype=torch.float64), None, 1.0)
    assert msg == "sample_rows: uniform must be contiguous float32 [3], got Double [2]"
    msg = _raises(ValueError, ops.sample_rows, logits, torch.tensor(0.5), None, 1.0)
    assert msg == "sample_rows: uniform must be contiguous float32 [3], got Float []"
    # floating point as an ostream prints it by default ("%g": six significant digits)
    for temperature, text in ((0.0, "0"), (-0.5, "-0.5"), (-1e-07, "-1e-07"), (-2.0 / 3.0, "-0.666667"),
                              (-1234567.0, "-1.23457e+06"), (float("-inf"), "-inf")):
        msg = _raises(ValueError, ops.sample_rows, logits, torch.rand(3), None, temperature)
        assert msg == f"sample_rows: temperature must be > 0, got {text}"
    msg = _raises(ValueError, ops.sample_rows, logits, torch.rand(3), torch.tensor([1, 7]), 1.0)
    assert msg == "sample_rows: suppressed token id 7 outside [0, 5)"


def test_moe_routing_messages(ops):
    logits = torch.randn(6, 4)
    msg = _raises(ValueError, ops.topk_gating, torch.randn(2, 3, 4), None, 2, False, 1, 1, True, 1.0)
    assert msg == "topk_gating: logits must be [N, E], got [2, 3, 4]"
    msg = _raises(ValueError, ops.topk_gating, logits.half(), None, 2, False, 1, 1, True, 1.0)
    assert msg == "topk_gating: logits must be float32, got Half"
    msg = _raises(ValueError, ops.topk_gating, logits, None, 5, False, 1, 1, True, 1.0)
    assert msg == "topk_gating: top_k 5 must be in 1..4"
    msg = _raises(ValueError, ops.topk_gating, logits, None, 1, False, 3, 1, True, 1.0)
    assert msg == "topk_gating: n_group 3 must divide 4 and topk_group 1 be in 1..n_group"
    msg = _raises(ValueError, ops.moe_permute_indices, torch.tensor([[0], [5], [1]]), 4)
    assert msg == "moe_permute_indices: expert id 5 outside 0..3"


def test_layer_op_messages(ops):
    x = torch.randn(2, 8)
    msg = _raises(ValueError, ops.rms_norm_fwd, x.double(), torch.ones(8), None, 1e-6)
    assert msg == "rms_norm: x must be a contiguous float32 CPU tensor"
    msg = _raises(ValueError, ops.rms_norm_fwd, x, torch.ones(6), None, 1e-6)
    assert msg == "rms_norm: weight must be [8]"
    msg = _raises(ValueError, ops.swiglu_fwd, torch.randn(2, 3), torch.randn(2, 4))
    assert msg == "swiglu: gate shape [2, 3] != up shape [2, 4]"


def test_messages_without_numbers_still_raise(ops):
    assert _raises(ValueError, ops.parallel_threads, 0) == "parallel_threads: n must be >= 1"
    msg = _raises(ValueError, ops.first_fit_pack, torch.tensor([3, 5]), torch.tensor([0, 1]), 0, 4)
    assert msg == "capacity must be > 0"
