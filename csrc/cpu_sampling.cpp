// Fused CPU token sampling of the rollout engine (rl/rollout/sampling.py `sample_tokens`, untruncated case).
//
// Why: per decoding step the torch path runs log_softmax, exp, an in-place cumsum, a clamp, searchsorted and a
// gather over the [rows, V] logits: five passes and three [rows, V] buffers, ~10 % of a CPU decode step at V = 8k.
// Here one row is three passes and no buffer: the max, the sum of exponentials (log-sum-exp), then the inverse
// CDF: the first token whose running probability mass exceeds u * total.
//
// The arithmetic follows the torch path: logits divided by the temperature; logp = x - m - log(sum exp(x - m));
// each token's probability exp(logp) (0 for suppressed tokens), accumulated in double; target = min(u * total,
// the float below total), total = the float of the whole sum; token = the first whose accumulated mass (as
// float) exceeds the target, so it has probability > 0 and is never a suppressed token. Returns the token and its
// logp (of the untruncated, unsuppressed distribution, as the torch path). The exponentials are this file's
// vector exp (relative error ~2e-7), so logp agrees with torch's to ~1e-6 and a token differs only when u lands
// within that of a CDF step.
#include "cpu_vec.h"
#include "check.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <vector>

namespace megatron_vlm {
namespace {

using namespace cpu_vec;  // NOLINT: the vector helpers of this file's kernels

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// x_i = z_i / t (t == 1: z_i itself, no division), padding lanes -inf
inline v8f scaled8(const float* z, int64_t i, int64_t k, float t, bool divide) {
  v8f x = load_part(z + i, k);
  if (divide) x = x / t;
  for (int64_t lane = k; lane < 8; ++lane) x[lane] = kNegInf;
  return x;
}

MVLM_CLONES void sample_row(const float* z, int64_t vocab, float t, float u, const unsigned char* suppressed,
                            int64_t* token, float* logp) {
  const bool divide = t != 1.0f;
  v8f mx = splat8(kNegInf);
  for_each8(vocab, [&](int64_t i, int64_t k) {
    const v8f x = scaled8(z, i, k, t, divide);
    mx = mx > x ? mx : x;
  });
  float m = mx[0];
  for (int lane = 1; lane < 8; ++lane) m = std::max(m, mx[lane]);
  v8f se = splat8(0.0f);
  for_each8(vocab, [&](int64_t i, int64_t k) {
    v8f e = vexp_nonpos(scaled8(z, i, k, t, divide) - m);
    for (int64_t lane = k; lane < 8; ++lane) e[lane] = 0.0f;
    se += e;
  });
  const float shift = m + std::log(hsum8(se));  // logp_i = x_i - shift
  if (!std::isfinite(shift)) {  // a NaN / +inf logit or only -inf ones: no distribution (the caller raises)
    *token = -1;
    *logp = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  // pass 3: probabilities exp(logp_i) in double running sums; the total first (the target depends on it), then the
  // search. A suppressed token contributes 0. Two sweeps over 8-wide blocks: block sums to find the total and
  // the block holding the target, then tokens one by one inside that block, in the same order and precision.
  double total = 0.0;
  std::vector<double> block_sums((vocab + 7) / 8);
  for_each8(vocab, [&](int64_t i, int64_t k) {
    const v8f x = scaled8(z, i, k, t, divide);
    v8f p = vexp_nonpos(x - shift);
    p = x == splat8(kNegInf) ? splat8(0.0f) : p;  // exp(-inf) = 0 (the vector exp clamps to ~1e-38)
    double b = 0.0;
    for (int64_t lane = 0; lane < k; ++lane) {
      if (suppressed == nullptr || !suppressed[i + lane]) b += static_cast<double>(p[lane]);
    }
    block_sums[i / 8] = b;
    total += b;
  });
  const float total_f = static_cast<float>(total);
  const float target = std::min(u * total_f, std::nextafter(total_f, 0.0f));
  double run = 0.0;
  int64_t pick = -1;
  for (int64_t blk = 0; blk < static_cast<int64_t>(block_sums.size()) && pick < 0; ++blk) {
    if (static_cast<float>(run + block_sums[blk]) <= target && blk + 1 < static_cast<int64_t>(block_sums.size())) {
      run += block_sums[blk];
      continue;
    }
    const int64_t i = blk * 8, k = std::min<int64_t>(8, vocab - i);
    const v8f x = scaled8(z, i, k, t, divide);
    v8f p = vexp_nonpos(x - shift);
    p = x == splat8(kNegInf) ? splat8(0.0f) : p;
    for (int64_t lane = 0; lane < k; ++lane) {
      if (suppressed != nullptr && suppressed[i + lane]) continue;
      run += static_cast<double>(p[lane]);
      if (static_cast<float>(run) > target) {
        pick = i + lane;
        break;
      }
    }
  }
  if (pick < 0) {  // rounding left the target at the very end: the last token with mass
    for (int64_t j = vocab - 1; j >= 0 && pick < 0; --j) {
      if (suppressed == nullptr || !suppressed[j]) pick = j;
    }
  }
  *token = pick;
  *logp = (divide ? z[pick] / t : z[pick]) - shift;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> sample_rows_cpu(const at::Tensor& logits, const at::Tensor& uniform,
                                                   const std::optional<at::Tensor>& suppress_ids, double temperature) {
  MVLM_CHECK_VALUE(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
                   "sample_rows: logits must be contiguous float32 [rows, vocab], got ", logits.scalar_type(), " ",
                   logits.sizes());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  MVLM_CHECK_VALUE(vocab > 0, "sample_rows: empty vocabulary");
  MVLM_CHECK_VALUE(uniform.dim() == 1 && uniform.size(0) == rows && uniform.scalar_type() == at::kFloat &&
                       uniform.is_contiguous(),
                   "sample_rows: uniform must be contiguous float32 [", rows, "], got ", uniform.scalar_type(), " ",
                   uniform.sizes());
  MVLM_CHECK_VALUE(temperature > 0.0, "sample_rows: temperature must be > 0, got ", temperature);
  std::vector<unsigned char> mask;
  if (suppress_ids.has_value() && suppress_ids->numel() > 0) {
    const at::Tensor ids = suppress_ids->to(at::kLong).contiguous();
    mask.assign(vocab, 0);
    const int64_t* idp = ids.data_ptr<int64_t>();
    for (int64_t j = 0; j < ids.numel(); ++j) {
      MVLM_CHECK_VALUE(idp[j] >= 0 && idp[j] < vocab, "sample_rows: suppressed token id ", idp[j], " outside [0, ",
                       vocab, ")");
      mask[idp[j]] = 1;
    }
    int64_t n_suppressed = 0;
    for (unsigned char b : mask) n_suppressed += b;
    MVLM_CHECK_VALUE(n_suppressed < vocab, "sample_rows: every token of the vocabulary is suppressed");
  }
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor logp = at::empty({rows}, logits.options());
  const float* z = logits.data_ptr<float>();
  const float* u = uniform.data_ptr<float>();
  int64_t* tk = tokens.data_ptr<int64_t>();
  float* lp = logp.data_ptr<float>();
  const unsigned char* sup = mask.empty() ? nullptr : mask.data();
  const float t = static_cast<float>(temperature);
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) sample_row(z + r * vocab, vocab, t, u[r], sup, tk + r, lp + r);
  });
  for (int64_t r = 0; r < rows; ++r) {  // raised here, on the calling thread, not inside the parallel region
    MVLM_CHECK_VALUE(tk[r] >= 0, "sample_rows: row ", r, " of the logits has a NaN or +inf value, or only -inf ones: "
                     "no distribution to sample from");
  }
  return {tokens, logp};
}

}  // namespace megatron_vlm
