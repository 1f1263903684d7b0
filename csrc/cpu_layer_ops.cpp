// CPU kernels of the per-token layer ops: RMSNorm (+ fused residual add) forward / backward, SwiGLU
// forward / backward (decode attention over the KV cache: cpu_decode_attention.cpp).
//
// Why: on a CPU the torch references of these ops are chains of 4-10 elementwise ATen calls, each
// allocating a fresh full-size temporary and streaming it through memory once; at the GRPO and SFT
// shapes of a small model that is a third of the step next to GEMMs that already run at the core's
// rate. Here each op reads its inputs once and writes its outputs once, with the row reductions in
// registers.
//
// Numerics: fp32 in and out (the Python wrappers in kernels/csrc/layer_ops.py send other dtypes to
// the torch reference); reductions in fp32 in a fixed order per row, so a row's result does not depend
// on the other rows, the thread count or the batch it came in. exp() is a Cephes-style polynomial
// (range reduction to [-ln2/2, ln2/2], degree-5 polynomial, exponent by bit arithmetic, relative error
// ~2e-7) in 8-wide vector code. Hot loops are compiled twice (AVX2 + FMA and the baseline ISA) and the
// loader picks one for the running CPU (GCC target_clones on x86-64).
#include "cpu_vec.h"
#include "check.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace megatron_vlm {
namespace {

using namespace cpu_vec;  // NOLINT: the vector helpers of this file's kernels

// ---- RMSNorm --------------------------------------------------------------------------------------

// Row reductions and elementwise loops below go through for_each8 (explicit 8-wide code, padded tail): the
// auto-vectoriser may peel a few scalar iterations to align a row, and how many depends on the row's address,
// which would make a row's sum (its rounding) depend on where it sits in the batch.
MVLM_CLONES void rms_norm_rows(const float* x, const float* res, const float* w, float* out, float* summed,
                               float* rstd, int64_t rows, int64_t h, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = x + r * h;
    if (res != nullptr) {
      float* sr = summed + r * h;
      const float* rr = res + r * h;
      for_each8(h, [&](int64_t i, int64_t k) { store_part(sr + i, load_part(s + i, k) + load_part(rr + i, k), k); });
      s = sr;
    }
    v8f acc = splat8(0.0f);
    for_each8(h, [&](int64_t i, int64_t k) {
      const v8f v = load_part(s + i, k);
      acc += v * v;
    });
    const float inv = 1.0f / std::sqrt(hsum8(acc) / static_cast<float>(h) + eps);
    rstd[r] = inv;
    float* o = out + r * h;
    for_each8(h, [&](int64_t i, int64_t k) { store_part(o + i, load_part(s + i, k) * inv * load_part(w + i, k), k); });
  }
}

// y = s * rstd * w: ds = rstd * g * w - s * rstd^3 * sum(g * w * s) / h (+ the gradient of the summed
// output), dw += g * s * rstd (into this chunk's partial row).
MVLM_CLONES void rms_norm_bwd_rows(const float* g, const float* g_summed, const float* s, const float* w,
                                   const float* rstd, float* gs, float* gw, int64_t rows, int64_t h) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gr = g + r * h;
    const float* sr = s + r * h;
    const float inv = rstd[r];
    v8f acc = splat8(0.0f);
    for_each8(h, [&](int64_t i, int64_t k) { acc += load_part(gr + i, k) * load_part(w + i, k) * load_part(sr + i, k); });
    const float c = inv * inv * inv * hsum8(acc) / static_cast<float>(h);
    float* o = gs + r * h;
    const float* gsr = g_summed != nullptr ? g_summed + r * h : nullptr;
    for_each8(h, [&](int64_t i, int64_t k) {
      const v8f gv = load_part(gr + i, k), sv = load_part(sr + i, k);
      v8f d = inv * gv * load_part(w + i, k) - c * sv;
      if (gsr != nullptr) d += load_part(gsr + i, k);
      store_part(o + i, d, k);
      store_part(gw + i, load_part(gw + i, k) + gv * sv * inv, k);
    });
  }
}

MVLM_CLONES void add_rows(const float* src, float* dst, int64_t n) {
  for_each8(n, [&](int64_t i, int64_t k) { store_part(dst + i, load_part(dst + i, k) + load_part(src + i, k), k); });
}

// ---- SwiGLU ---------------------------------------------------------------------------------------

MVLM_CLONES void swiglu_fwd_span(const float* g, const float* u, float* o, int64_t n) {
  for_each8(n, [&](int64_t i, int64_t k) {
    const v8f x = load_part(g + i, k);
    store_part(o + i, x * vsigmoid(x) * load_part(u + i, k), k);
  });
}

// out = silu(g) * u: du = grad * silu(g); dg = grad * u * sig(g) * (1 + g * (1 - sig(g))).
MVLM_CLONES void swiglu_bwd_span(const float* grad, const float* g, const float* u, float* dg, float* du,
                                 int64_t n) {
  for_each8(n, [&](int64_t i, int64_t k) {
    const v8f x = load_part(g + i, k), gr = load_part(grad + i, k);
    const v8f sg = vsigmoid(x);
    store_part(du + i, gr * x * sg, k);
    store_part(dg + i, gr * load_part(u + i, k) * sg * (1.0f + x * (1.0f - sg)), k);
  });
}

// ---- rotary (rotate-half convention, full width) --------------------------------------------------

// out = x * cos + rotate_half(x) * sin per head, rotate_half(x1, x2) = (-x2, x1); backward (transpose):
// g_x1 = g1 * cos1 + g2 * sin2, g_x2 = g2 * cos2 - g1 * sin1.
MVLM_CLONES void rotary_rows(const float* x, const float* cs, const float* sn, float* out, int64_t rows, int64_t heads,
                             int64_t d, bool backward) {
  const int64_t half = d / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cs + r * d;
    const float* s = sn + r * d;
    for (int64_t h = 0; h < heads; ++h) {
      const float* xr = x + (r * heads + h) * d;
      float* o = out + (r * heads + h) * d;
      for_each8(half, [&](int64_t i, int64_t k) {
        const v8f x1 = load_part(xr + i, k), x2 = load_part(xr + half + i, k);
        const v8f c1 = load_part(c + i, k), c2 = load_part(c + half + i, k);
        const v8f s1 = load_part(s + i, k), s2 = load_part(s + half + i, k);
        if (!backward) {
          store_part(o + i, x1 * c1 - x2 * s1, k);
          store_part(o + half + i, x2 * c2 + x1 * s2, k);
        } else {
          store_part(o + i, x1 * c1 + x2 * s2, k);
          store_part(o + half + i, x2 * c2 - x1 * s1, k);
        }
      });
    }
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  MVLM_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
                   " must be a contiguous float32 CPU tensor");
}

constexpr int64_t kNormChunk = 256;  // rows per partial weight-gradient row (fixed: deterministic sums)

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_fwd_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                                const std::optional<at::Tensor>& residual,
                                                                double eps) {
  check_rows(x, "rms_norm: x");
  check_rows(weight, "rms_norm: weight");
  const int64_t h = x.size(-1);
  MVLM_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == h, "rms_norm: weight must be [", h, "]");
  const int64_t rows = h ? x.numel() / h : 0;
  auto out = at::empty_like(x);
  auto rstd = at::empty({rows}, x.options());
  at::Tensor summed;
  const float* res = nullptr;
  if (residual.has_value()) {
    check_rows(*residual, "rms_norm: residual");
    MVLM_CHECK_VALUE(residual->sizes() == x.sizes(), "rms_norm: residual shape must equal x's");
    summed = at::empty_like(x);
    res = residual->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* sp = summed.defined() ? summed.data_ptr<float>() : nullptr;
  float* rp = rstd.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(h, 1)), [&](int64_t b, int64_t e) {
    rms_norm_rows(xp + b * h, res ? res + b * h : nullptr, wp, op + b * h, sp ? sp + b * h : nullptr, rp + b,
                  e - b, h, static_cast<float>(eps));
  });
  return {out, summed.defined() ? summed : at::empty({0}, x.options()), rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cpu(const at::Tensor& grad, const std::optional<at::Tensor>& grad_summed,
                                                    const at::Tensor& normed_input, const at::Tensor& weight,
                                                    const at::Tensor& rstd) {
  check_rows(grad, "rms_norm backward: grad");
  check_rows(normed_input, "rms_norm backward: input");
  check_rows(weight, "rms_norm backward: weight");
  check_rows(rstd, "rms_norm backward: rstd");
  MVLM_CHECK_VALUE(grad.sizes() == normed_input.sizes(), "rms_norm backward: grad shape must equal the input's");
  const int64_t h = normed_input.size(-1);
  const int64_t rows = h ? normed_input.numel() / h : 0;
  const float* gsp = nullptr;
  if (grad_summed.has_value()) {
    check_rows(*grad_summed, "rms_norm backward: grad of the sum");
    MVLM_CHECK_VALUE(grad_summed->sizes() == grad.sizes(), "rms_norm backward: grad of the sum has the wrong shape");
    gsp = grad_summed->data_ptr<float>();
  }
  auto gs = at::empty_like(normed_input);
  const int64_t chunks = (rows + kNormChunk - 1) / kNormChunk;
  auto partial = at::zeros({std::max<int64_t>(chunks, 1), h}, weight.options());
  const float* gp = grad.data_ptr<float>();
  const float* sp = normed_input.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* rp = rstd.data_ptr<float>();
  float* out = gs.data_ptr<float>();
  float* pp = partial.data_ptr<float>();
  at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const int64_t r0 = c * kNormChunk, n = std::min(kNormChunk, rows - r0);
      rms_norm_bwd_rows(gp + r0 * h, gsp ? gsp + r0 * h : nullptr, sp + r0 * h, wp, rp + r0, out + r0 * h,
                        pp + c * h, n, h);
    }
  });
  auto gw = at::empty({h}, weight.options());
  float* gwp = gw.data_ptr<float>();
  std::memcpy(gwp, pp, sizeof(float) * h);
  for (int64_t c = 1; c < chunks; ++c) add_rows(pp + c * h, gwp, h);
  return {gs, gw};
}

at::Tensor swiglu_fwd_cpu(const at::Tensor& gate, const at::Tensor& up) {
  check_rows(gate, "swiglu: gate");
  check_rows(up, "swiglu: up");
  MVLM_CHECK_VALUE(gate.sizes() == up.sizes(), "swiglu: gate shape ", gate.sizes(), " != up shape ", up.sizes());
  auto out = at::empty_like(gate);
  const float* g = gate.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, gate.numel(), 32768, [&](int64_t b, int64_t e) { swiglu_fwd_span(g + b, u + b, o + b, e - b); });
  return out;
}

std::tuple<at::Tensor, at::Tensor> swiglu_bwd_cpu(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up) {
  check_rows(grad, "swiglu backward: grad");
  check_rows(gate, "swiglu backward: gate");
  check_rows(up, "swiglu backward: up");
  MVLM_CHECK_VALUE(gate.sizes() == up.sizes() && grad.sizes() == gate.sizes(), "swiglu backward: shapes differ");
  auto dg = at::empty_like(gate);
  auto du = at::empty_like(up);
  const float* gr = grad.data_ptr<float>();
  const float* g = gate.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  float* dgp = dg.data_ptr<float>();
  float* dup = du.data_ptr<float>();
  at::parallel_for(0, gate.numel(), 32768, [&](int64_t b, int64_t e) {
    swiglu_bwd_span(gr + b, g + b, u + b, dgp + b, dup + b, e - b);
  });
  return {dg, du};
}

at::Tensor rotary_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  check_rows(x, "apply_rotary: x");
  check_rows(cos, "apply_rotary: cos");
  check_rows(sin, "apply_rotary: sin");
  MVLM_CHECK_VALUE(x.dim() == 3 && cos.sizes() == sin.sizes() && cos.numel() == x.size(0) * x.size(2) &&
                       cos.size(-1) == x.size(2) && x.size(2) % 2 == 0,
                   "apply_rotary: x [N, H, D] (D even) with cos / sin of N x D values");
  auto out = at::empty_like(x);
  const int64_t heads = x.size(1), d = x.size(2);
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), std::max<int64_t>(1, 16384 / std::max<int64_t>(heads * d, 1)), [&](int64_t b, int64_t e) {
    rotary_rows(xp + b * heads * d, cp + b * d, sp + b * d, op + b * heads * d, e - b, heads, d, backward);
  });
  return out;
}

int64_t parallel_threads(int64_t n) {
  MVLM_CHECK_VALUE(n >= 1, "parallel_threads: n must be >= 1");
  std::vector<char> used(std::max(at::get_num_threads(), 1), 0);
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    const int t = at::get_thread_num();
    if (t >= 0 && t < static_cast<int>(used.size())) used[t] = 1;
  });
  return std::count(used.begin(), used.end(), 1);
}

}  // namespace megatron_vlm
