"""csrc/check.h compiled on its own (torch.utils.cpp_extension.load_inline): mvlm::msg gives the text c10::str
(PyTorch's ostream-based formatting, what TORCH_CHECK* used) gives for every type it supports, and each macro,
MVLM_CHECK / MVLM_CHECK_VALUE / MVLM_CHECK_INDEX, raises RuntimeError / ValueError / IndexError with that text,
evaluates its condition once and builds the message only on failure.

It compiles against the torch headers (a minute or more), hence heavy; the messages of the built extension's own
checks are in test_csrc_error_messages.py.
"""
import shutil
from pathlib import Path

import pytest
import torch

CSRC = Path(__file__).resolve().parents[3] / "csrc"

_SOURCE = r"""
#include <torch/library.h>
#include "check.h"

#include <climits>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace {

// Pairs (mvlm::msg(args...), c10::str(args...)), flattened.
std::vector<std::string> pairs() {
  std::vector<std::string> out;
#define BOTH(...)                               \
  out.push_back(::mvlm::msg(__VA_ARGS__));      \
  out.push_back(::c10::str(__VA_ARGS__))
  const int64_t neg = -5;
  const int64_t lo = INT64_MIN;
  const uint64_t hi = UINT64_MAX;
  BOTH("n ", neg, " of ", hi, " min ", lo);
  BOTH(int{7}, " ", short{-3}, " ", 4u, " ", 9ul, " ", int32_t{INT32_MIN}, " ", uint16_t{65535});
  BOTH(0.0, " ", -0.5, " ", 1e-7, " ", 1234567.0, " ", 2.0 / 3.0, " ", 1e300, " ", 0.1f, " ", -0.0);
  BOTH(HUGE_VAL, " ", -HUGE_VAL, " ", 100000.0, " ", 1000000.0, " ", 123456789.0f, " ", 5e-5);
  BOTH(c10::kFloat, " ", c10::kBFloat16, " ", c10::ScalarType::Long, " ", at::kBool);
  const at::Tensor t = at::empty({2, 3, 4});
  const std::vector<int64_t> one{7};
  BOTH("got ", t.sizes(), " ", c10::IntArrayRef{}, " ", c10::IntArrayRef(one), " ", at::empty({0, 5}).sizes());
  const std::string s = "abc";
  const char* p = "ptr";
  BOTH(s, 'x', "lit", p, true, false, static_cast<signed char>('y'), static_cast<unsigned char>('z'));
  BOTH("only a literal");
#undef BOTH
  return out;
}

int64_t g_conditions = 0;
int64_t g_messages = 0;

int64_t counted(int64_t v) {
  ++g_messages;
  return v;
}

void check_plain(int64_t v) { MVLM_CHECK((++g_conditions, v >= 0), "plain: ", counted(v), " < 0"); }
void check_value(int64_t v) { MVLM_CHECK_VALUE((++g_conditions, v >= 0), "value: ", counted(v), " < 0, ", at::kHalf); }
void check_index(int64_t v) {
  MVLM_CHECK_INDEX((++g_conditions, v >= 0), "index: ", counted(v), " outside ", at::empty({3, 1}).sizes());
}

std::vector<int64_t> counts() { return {g_conditions, g_messages}; }

}  // namespace

TORCH_LIBRARY(mvlm_check_header_test, m) {
  m.def("pairs", &pairs);
  m.def("plain", &check_plain);
  m.def("value", &check_value);
  m.def("index", &check_index);
  m.def("counts", &counts);
}
"""


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    from torch.utils import cpp_extension

    build = tmp_path_factory.mktemp("check_header")
    cpp_extension.load_inline("mvlm_check_header_test", [_SOURCE], extra_include_paths=[str(CSRC)],
                              extra_cflags=["-O1"], build_directory=str(build), is_python_module=False)
    return torch.ops.mvlm_check_header_test


@pytest.mark.slow
@pytest.mark.heavy
def test_msg_gives_the_text_of_c10_str(checks):
    flat = checks.pairs()
    assert len(flat) == 16
    for ours, c10_text in zip(flat[0::2], flat[1::2]):
        assert ours == c10_text
    # and the texts are the ones expected (not two empty strings)
    assert flat[0] == "n -5 of 18446744073709551615 min -9223372036854775808"
    assert flat[4] == "0 -0.5 1e-07 1.23457e+06 0.666667 1e+300 0.1 -0"
    assert flat[8] == "Float BFloat16 Long Bool"
    assert flat[10] == "got [2, 3, 4] [] [7] [0, 5]"
    assert flat[12] == "abcxlitptr10yz"


@pytest.mark.slow
@pytest.mark.heavy
def test_each_macro_raises_its_error_with_the_message_built_only_on_failure(checks):
    conditions, messages = checks.counts()
    for fn in (checks.plain, checks.value, checks.index):
        fn(3)
    assert checks.counts() == [conditions + 3, messages]  # passing checks: the condition once, no message
    cases = ((checks.plain, RuntimeError, "plain: -2 < 0"), (checks.value, ValueError, "value: -2 < 0, Half"),
             (checks.index, IndexError, "index: -2 outside [3, 1]"))
    for fn, exc_type, text in cases:
        with pytest.raises(exc_type) as info:
            fn(-2)
        assert type(info.value) is exc_type
        assert str(info.value).splitlines()[0] == text
    assert checks.counts() == [conditions + 6, messages + 3]
