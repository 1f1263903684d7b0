// CPU row algebra of the fused LM head + token log-probs (`kernels.linear_token_logprobs`, csrc backend).
//
// Why: per chunk of rows the reference runs the logits' log-sum-exp, the label gather, the softmax and the entropy
// sum (forward), and exp / multiply / scatter / entropy terms / division (backward) as separate ATen calls over the
// [chunk, V] block: ~6 passes forward and ~10 backward, a tenth of a CPU GRPO update at the trl_grpo.py shape. Here
// each is one pass per row; the GEMMs stay in ATen (kernels/csrc/token_logprobs.py).
//
// Per row of z (logits already divided by the temperature): lse = log sum exp z, logp = z[label] - lse,
// entropy H = lse - sum softmax(z) z. Gradient w.r.t. z: g = (onehot(label) - p) dlogp - p (z - lse + H) dH,
// times 1 / temperature, written over z. float32, rows contiguous; labels int64 in [0, V) (the wrapper maps
// ignored labels to 0 and zeroes their gradients).
#include "cpu_vec.h"
#include "check.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <limits>

namespace megatron_vlm {
namespace {

using namespace cpu_vec;  // NOLINT: the vector helpers of this file's kernels

MVLM_CLONES void fwd_rows(const float* z, const int64_t* labels, float* logp, float* lse, float* ent, int64_t rows,
                          int64_t vocab, bool with_entropy) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* zr = z + r * vocab;
    v8f mx = splat8(-std::numeric_limits<float>::infinity());
    for_each8(vocab, [&](int64_t i, int64_t k) {
      v8f x = load_part(zr + i, k);
      if (k < 8) {
        for (int64_t lane = k; lane < 8; ++lane) x[lane] = -std::numeric_limits<float>::infinity();
      }
      mx = mx > x ? mx : x;
    });
    float m = mx[0];
    for (int lane = 1; lane < 8; ++lane) m = std::max(m, mx[lane]);
    v8f se = splat8(0.0f), sz = splat8(0.0f);
    for_each8(vocab, [&](int64_t i, int64_t k) {
      const v8f x = load_part(zr + i, k) - m;
      v8f e = vexp_nonpos(x);
      if (k < 8) {
        for (int64_t lane = k; lane < 8; ++lane) e[lane] = 0.0f;
      }
      se += e;
      sz += e * x;
    });
    // H = lse - sum p z = log s - sum p (z - m): the max cancels exactly instead of in rounding
    const float s = hsum8(se), l = m + std::log(s);
    lse[r] = l;
    logp[r] = zr[labels[r]] - l;
    ent[r] = with_entropy ? std::log(s) - hsum8(sz) / s : 0.0f;
  }
}

MVLM_CLONES void bwd_rows(float* z, const int64_t* labels, const float* lse, const float* ent, const float* gl,
                          const float* ge, int64_t rows, int64_t vocab, float inv_t) {
  for (int64_t r = 0; r < rows; ++r) {
    float* zr = z + r * vocab;
    const float l = lse[r], a = gl[r];
    const float b = ge != nullptr ? ge[r] : 0.0f, h = ge != nullptr ? ent[r] : 0.0f;
    for_each8(vocab, [&](int64_t i, int64_t k) {
      const v8f x = load_part(zr + i, k);
      const v8f lp = x - l;
      const v8f p = vexp_nonpos(lp);
      v8f g = -p * a;
      if (ge != nullptr) g -= p * (lp + h) * b;
      store_part(zr + i, g * inv_t, k);
    });
    zr[labels[r]] += a * inv_t;
  }
}

void check_z(const at::Tensor& z, const at::Tensor& labels) {
  MVLM_CHECK_VALUE(z.device().is_cpu() && z.scalar_type() == at::kFloat && z.is_contiguous() && z.dim() == 2 &&
                       z.size(1) > 0,
                   "token log-probs (csrc): z must be a contiguous float32 CPU [N, V] tensor");
  MVLM_CHECK_VALUE(labels.scalar_type() == at::kLong && labels.is_contiguous() && labels.numel() == z.size(0),
                   "token log-probs (csrc): labels must be int64 [N]");
  const int64_t* lab = labels.data_ptr<int64_t>();
  for (int64_t r = 0; r < z.size(0); ++r) {
    MVLM_CHECK_INDEX(lab[r] >= 0 && lab[r] < z.size(1), "token log-probs (csrc): label ", lab[r], " outside [0, ",
                     z.size(1), ")");
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> token_logprob_rows_cpu(const at::Tensor& z, const at::Tensor& labels,
                                                                      bool with_entropy) {
  check_z(z, labels);
  const int64_t rows = z.size(0), vocab = z.size(1);
  auto logp = at::empty({rows}, z.options()), lse = at::empty({rows}, z.options()), ent = at::empty({rows}, z.options());
  const float* zp = z.data_ptr<float>();
  const int64_t* lab = labels.data_ptr<int64_t>();
  float* lp = logp.data_ptr<float>();
  float* sp = lse.data_ptr<float>();
  float* ep = ent.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / vocab), [&](int64_t b, int64_t e) {
    fwd_rows(zp + b * vocab, lab + b, lp + b, sp + b, ep + b, e - b, vocab, with_entropy);
  });
  return {logp, lse, ent};
}

void token_logprob_grad_rows_cpu(const at::Tensor& z, const at::Tensor& labels, const at::Tensor& lse,
                                 const at::Tensor& ent, const at::Tensor& grad_logp,
                                 const std::optional<at::Tensor>& grad_ent, double inv_temperature) {
  check_z(z, labels);
  const int64_t rows = z.size(0), vocab = z.size(1);
  for (const auto* t : {&lse, &ent, &grad_logp}) {
    MVLM_CHECK_VALUE(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == rows,
                     "token log-probs (csrc): lse / entropy / gradients must be float32 [N]");
  }
  const float* ge = nullptr;
  if (grad_ent.has_value()) {
    MVLM_CHECK_VALUE(grad_ent->scalar_type() == at::kFloat && grad_ent->is_contiguous() && grad_ent->numel() == rows,
                     "token log-probs (csrc): entropy gradient must be float32 [N]");
    ge = grad_ent->data_ptr<float>();
  }
  float* zp = z.data_ptr<float>();
  const int64_t* lab = labels.data_ptr<int64_t>();
  const float* sp = lse.data_ptr<float>();
  const float* ep = ent.data_ptr<float>();
  const float* gp = grad_logp.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / vocab), [&](int64_t b, int64_t e) {
    bwd_rows(zp + b * vocab, lab + b, sp + b, ep + b, gp + b, ge ? ge + b : nullptr, e - b, vocab,
             static_cast<float>(inv_temperature));
  });
}

}  // namespace megatron_vlm
