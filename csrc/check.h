// Argument checks of the extension's ops whose failure messages are built without any iostream.
//
// Why: on a CUDA machine (NVIDIA H200, torch 2.11.0+cu130, extension built with g++ 13.3 + nvcc 13.0, the
// system libstdc++.so.6 loaded at run time) a TORCH_CHECK whose message held a number crashed the process
// with SIGSEGV instead of raising (under pytest there; a plain `python -c` raised). TORCH_CHECK formats its
// arguments with c10::str, an std::ostringstream; inserting a `long` goes through the locale's num_put facet,
// and cuda-gdb showed the crash right there:
//   #0 std::codecvt<char16_t, ...>::do_unshift          (in megatron_vlm/_C.so)
//   #1 std::basic_ostream<char>::_M_insert<long>(long)   (in megatron_vlm/_C.so)
//   #2 c10::detail::_str_wrapper<...>::call               (in megatron_vlm/_C.so)
// Most likely the stream code instantiated in our .so from the toolchain's headers did not agree with the locale
// facets of the libstdc++ loaded at run time. Checks with string-literal-only messages raised fine (inserting a
// string uses no facet). The machine cannot be fixed from here, so the extension never formats through an
// iostream: mvlm::msg builds the text by appending, and gives what c10::str (an ostream's defaults) gives:
// std::to_string for integers, snprintf "%g" for floating point, c10::toString for dtypes, "[a, b, c]" for
// sizes, 1 / 0 for bools, characters for the char types. The MVLM_CHECK* macros hand it to the matching
// TORCH_CHECK* as one C string, which c10 passes through unformatted. The message is built only when the check
// fails.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/macros/Macros.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <type_traits>

namespace mvlm {
namespace detail {

template <typename T>
inline constexpr bool kNoFormatting = false;

template <typename T>
void append(std::string& out, const T& v) {
  using U = std::decay_t<T>;
  if constexpr (std::is_same_v<U, bool>) {
    out += v ? '1' : '0';
  } else if constexpr (std::is_same_v<U, char> || std::is_same_v<U, signed char> || std::is_same_v<U, unsigned char>) {
    out += static_cast<char>(v);
  } else if constexpr (std::is_integral_v<U> && std::is_signed_v<U>) {
    out += std::to_string(static_cast<long long>(v));
  } else if constexpr (std::is_integral_v<U>) {
    out += std::to_string(static_cast<unsigned long long>(v));
  } else if constexpr (std::is_floating_point_v<U>) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
    out += buf;
  } else if constexpr (std::is_same_v<U, c10::ScalarType>) {
    out += c10::toString(v);
  } else if constexpr (std::is_convertible_v<const T&, const char*>) {
    const char* s = v;
    out += s != nullptr ? s : "(null)";
  } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    out += std::string_view(v);
  } else if constexpr (std::is_convertible_v<const T&, c10::IntArrayRef>) {
    const c10::IntArrayRef list = v;
    out += '[';
    for (size_t i = 0; i < list.size(); ++i) {
      if (i > 0) out += ", ";
      out += std::to_string(static_cast<long long>(list[i]));
    }
    out += ']';
  } else {
    static_assert(kNoFormatting<T>, "mvlm::msg: no formatting for this type; add one here (never an iostream)");
  }
}

}  // namespace detail

/// The concatenated text of `args`, built without iostreams (see the top of this file).
template <typename... Args>
std::string msg(const Args&... args) {
  std::string out;
  (detail::append(out, args), ...);
  return out;
}

}  // namespace mvlm

// MVLM_CHECK* (cond, message parts...): like TORCH_CHECK*, but the message parts are joined by mvlm::msg, only
// when `cond` is false, and given to the TORCH_CHECK* as a single C string. A message is required.
#define MVLM_CHECK_THROW_(torch_check, cond, ...)                  \
  do {                                                             \
    if (C10_UNLIKELY(!(cond))) {                                   \
      const std::string mvlm_check_msg_ = ::mvlm::msg(__VA_ARGS__); \
      torch_check(false, mvlm_check_msg_.c_str());                 \
    }                                                              \
  } while (false)

// RuntimeError in Python.
#define MVLM_CHECK(cond, ...) MVLM_CHECK_THROW_(TORCH_CHECK, cond, __VA_ARGS__)
// ValueError in Python.
#define MVLM_CHECK_VALUE(cond, ...) MVLM_CHECK_THROW_(TORCH_CHECK_VALUE, cond, __VA_ARGS__)
// IndexError in Python.
#define MVLM_CHECK_INDEX(cond, ...) MVLM_CHECK_THROW_(TORCH_CHECK_INDEX, cond, __VA_ARGS__)
