// CPU attention over packed variable-length samples (`kernels.attention` with cu_seqlens), forward and backward.
//
// Why: a GRPO / SFT pack on the CPU holds many short samples (tens of tokens each). Torch's flash SDPA needs them
// as a padded batch with a mask: gathers into [n, max_len, H, D], the masked kernel over the padding, a boolean
// gather back, and all of that again in the backward (~0.1 s of a 0.7 s GRPO update at the trl_grpo.py shape).
// Here one task per (sample, kv head) reads the sample's rows of the packed q / k / v in place: for each query
// row, the scores over its visible keys, their softmax, the output, and the log-sum-exp for the backward,
// which recomputes the probabilities from it (no S x S matrix is kept).
//
// Contract (kernels/reference/attention.py): q [Tq, Hq, D], k / v [Tk, Hkv, D] (GQA: Hkv divides Hq), sample s =
// queries cu_q[s]..cu_q[s+1] and keys cu_k[s]..cu_k[s+1]; causal with bottom-right alignment (query i of Lq sees
// keys j <= i + Lk - Lq); a query seeing no key outputs zeros (lse = -inf, zero gradient). float32, rows
// contiguous, D a multiple of 8 and <= 512 (the Python wrapper sends anything else to SDPA). Costs O(L^2) per
// sample without blocking, and the backward keeps P and dS (L x L per head of a group): the wrapper uses it for
// short samples only.
#include "cpu_vec.h"
#include "check.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <limits>
#include <vector>

namespace megatron_vlm {
namespace {

using namespace cpu_vec;  // NOLINT: the vector helpers of this file's kernels

constexpr int64_t kMaxHeadDim = 512;

struct Sample {
  int64_t q0, lq, k0, lk;
};

std::vector<Sample> samples_of(const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t tq, int64_t tk) {
  const auto cq = cu_q.to(at::kLong).contiguous(), ck = cu_k.to(at::kLong).contiguous();
  MVLM_CHECK_VALUE(cq.dim() == 1 && ck.dim() == 1 && cq.numel() == ck.numel() && cq.numel() >= 1,
                   "attention: cu_seqlens_q / cu_seqlens_k must be 1-D of equal length");
  const int64_t* a = cq.data_ptr<int64_t>();
  const int64_t* b = ck.data_ptr<int64_t>();
  const int64_t n = cq.numel() - 1;
  MVLM_CHECK_VALUE(a[0] == 0 && b[0] == 0 && a[n] == tq && b[n] == tk,
                   "attention: cu_seqlens must start at 0, not decrease and end at the token counts (q ", tq, ", k ", tk,
                   ")");
  std::vector<Sample> out(n);
  for (int64_t s = 0; s < n; ++s) {
    MVLM_CHECK_VALUE(a[s + 1] >= a[s] && b[s + 1] >= b[s],
                     "attention: cu_seqlens must start at 0, not decrease and end at the token counts");
    out[s] = {a[s], a[s + 1] - a[s], b[s], b[s + 1] - b[s]};
  }
  return out;
}

// Keys query i of a sample sees (a prefix of the sample's keys).
inline int64_t visible(const Sample& s, int64_t i, bool causal) {
  return causal ? std::min(s.lk, i + s.lk - s.lq + 1) : s.lk;
}

MVLM_CLONES void fwd_task(const float* q, const float* k, const float* v, float* out, float* lse, const Sample& s,
                          int64_t kvh, int64_t hq, int64_t hkv, int64_t d, bool causal, float scale,
                          std::vector<int64_t>& rows, std::vector<float>& scores) {
  const int64_t group = hq / hkv;
  rows.resize(s.lk);
  for (int64_t j = 0; j < s.lk; ++j) rows[j] = (s.k0 + j) * hkv + kvh;
  scores.resize(group * std::max<int64_t>(s.lk, 1));
  for (int64_t i = 0; i < s.lq; ++i) {
    const int64_t t = s.q0 + i, n = visible(s, i, causal), h0 = kvh * group;
    if (n <= 0) {  // no visible key: zeros (already), lse -inf
      for (int64_t g = 0; g < group; ++g) lse[t * hq + h0 + g] = -std::numeric_limits<float>::infinity();
      continue;
    }
    const float* qt = q + (t * hq + h0) * d;
    float* ot = out + (t * hq + h0) * d;
    if (d == 64) {
      decode_attention_rows<8>(qt, d, k, v, rows.data(), n, group, d, scale, scores.data(), ot, lse + t * hq + h0);
    } else if (d == 128) {
      decode_attention_rows<16>(qt, d, k, v, rows.data(), n, group, d, scale, scores.data(), ot, lse + t * hq + h0);
    } else {
      decode_attention_rows<0>(qt, d, k, v, rows.data(), n, group, d, scale, scores.data(), ot, lse + t * hq + h0);
    }
  }
}

// The dot product of a and b: cpu_vec.h's two-chain dot_parts, its 8 lanes summed.
inline float dot(const float* a, const float* b, int64_t chunks) { return hsum8(dot_parts<0>(a, b, chunks)); }

// out[0:8 kC) = scale * sum_r w[r * w_stride] * rows[r] for r in [r0, r1), rows `row_stride` floats apart: the
// weighted row sums of the backward (dq = dS K, dk = dS^T Q, dv = P^T dO), accumulated in registers (kC = D / 8
// chunks, a template constant for the common head sizes; 0 = runtime, accumulating in `out`).
template <int64_t kC>
__attribute__((always_inline)) inline void weighted_rows(float* out, int64_t chunks, const float* w, int64_t w_stride,
                                                         const float* rows, int64_t row_stride, int64_t r0, int64_t r1,
                                                         float scale, bool accumulate) {
  if (kC > 0) {
    v8f acc[kC > 0 ? kC : 1];
    for (int64_t c = 0; c < kC; ++c) acc[c] = accumulate ? load8(out + 8 * c) : splat8(0.0f);
    for (int64_t r = r0; r < r1; ++r) {
      const float a = w[r * w_stride] * scale;
      const float* src = rows + r * row_stride;
      for (int64_t c = 0; c < kC; ++c) acc[c] += a * load8(src + 8 * c);
    }
    for (int64_t c = 0; c < kC; ++c) store8(out + 8 * c, acc[c]);
  } else {
    if (!accumulate) {
      for (int64_t c = 0; c < chunks; ++c) store8(out + 8 * c, splat8(0.0f));
    }
    for (int64_t r = r0; r < r1; ++r) {
      const float a = w[r * w_stride] * scale;
      const float* src = rows + r * row_stride;
      for (int64_t c = 0; c < chunks; ++c) store8(out + 8 * c, load8(out + 8 * c) + a * load8(src + 8 * c));
    }
  }
}

// Backward of one (sample, kv head), in two passes per query head h of the group:
//   rows: P_ij = exp(scale q_i.k_j - lse_i), dS_ij = P_ij (dO_i.v_j - dO_i.O_i) for the visible keys (kept in
//         `p` / `ds`, Lq x Lk), and dq_i = scale sum_j dS_ij k_j;
//   keys: dk_j = scale sum_{h, i} dS_ij q_i and dv_j = sum_{h, i} P_ij dO_i over the rows that see key j.
// dk / dv rows of this kv head and sample belong to this task alone (no races; a fixed summation order).
template <int64_t kC>
__attribute__((always_inline)) inline void bwd_rows(const float* q, const float* k, const float* v, const float* out,
                                                    const float* lse, const float* dout, float* dq, float* dk,
                                                    float* dv, const Sample& s, int64_t kvh, int64_t hq, int64_t hkv,
                                                    int64_t d, bool causal, float scale, float* p, float* ds) {
  const int64_t group = hq / hkv, chunks = d / 8, lk = s.lk, lq = s.lq;
  const int64_t kstride = hkv * d, qstride = hq * d;
  const float* kb = k + (s.k0 * hkv + kvh) * d;  // key j of this sample / head at kb + j * kstride
  const float* vb = v + (s.k0 * hkv + kvh) * d;
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = kvh * group + g;
    float* pg = p + g * lq * lk;
    float* dsg = ds + g * lq * lk;
    for (int64_t i = 0; i < lq; ++i) {
      const int64_t t = s.q0 + i, n = visible(s, i, causal);
      float* dqr = dq + (t * hq + h) * d;
      if (n <= 0) continue;  // dq stays zero
      const float* qr = q + (t * hq + h) * d;
      const float* dor = dout + (t * hq + h) * d;
      const float l = lse[t * hq + h];
      const float delta = dot(dor, out + (t * hq + h) * d, chunks);
      float* pr = pg + i * lk;
      float* dsr = dsg + i * lk;
      int64_t j = 0;
      for (; j + 8 <= n; j += 8) {  // 8 keys at once: hsum8x8 gives the bits of 8 hsum8 calls
        v8f sq[8], sv[8];
        for (int u = 0; u < 8; ++u) {
          sq[u] = dot_parts<0>(qr, kb + (j + u) * kstride, chunks);
          sv[u] = dot_parts<0>(dor, vb + (j + u) * kstride, chunks);
        }
        const v8f scores = hsum8x8(sq), dps = hsum8x8(sv);
        for (int u = 0; u < 8; ++u) {  // the scalar tail's expressions, lane by lane
          pr[j + u] = scores[u] * scale - l;
          dsr[j + u] = dps[u] - delta;
        }
      }
      for (; j < n; ++j) {
        pr[j] = dot(qr, kb + j * kstride, chunks) * scale - l;
        dsr[j] = dot(dor, vb + j * kstride, chunks) - delta;
      }
      for_each8(n, [&](int64_t j, int64_t kk) {
        const v8f e = vexp_nonpos(load_part(pr + j, kk));
        store_part(pr + j, e, kk);
        store_part(dsr + j, e * load_part(dsr + j, kk), kk);
      });
      weighted_rows<kC>(dqr, chunks, dsr, 1, kb, kstride, 0, n, scale, false);
    }
  }
  for (int64_t j = 0; j < lk; ++j) {
    // rows that see key j: i + lk - lq >= j (causal), all rows otherwise
    const int64_t i0 = causal ? std::max<int64_t>(0, j - (lk - lq)) : 0;
    float* dkr = dk + ((s.k0 + j) * hkv + kvh) * d;
    float* dvr = dv + ((s.k0 + j) * hkv + kvh) * d;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = kvh * group + g;
      const float* qh = q + (s.q0 * hq + h) * d;
      const float* doh = dout + (s.q0 * hq + h) * d;
      weighted_rows<kC>(dkr, chunks, ds + g * lq * lk + j, lk, qh, qstride, i0, lq, scale, g > 0);
      weighted_rows<kC>(dvr, chunks, p + g * lq * lk + j, lk, doh, qstride, i0, lq, 1.0f, g > 0);
    }
  }
}

MVLM_CLONES void bwd_task(const float* q, const float* k, const float* v, const float* out, const float* lse,
                          const float* dout, float* dq, float* dk, float* dv, const Sample& s, int64_t kvh, int64_t hq,
                          int64_t hkv, int64_t d, bool causal, float scale, std::vector<float>& scratch) {
  const int64_t group = hq / hkv;
  scratch.resize(2 * group * std::max<int64_t>(s.lq * s.lk, 1));
  float* p = scratch.data();
  float* ds = p + group * s.lq * s.lk;
  if (d == 64) {
    bwd_rows<8>(q, k, v, out, lse, dout, dq, dk, dv, s, kvh, hq, hkv, d, causal, scale, p, ds);
  } else if (d == 128) {
    bwd_rows<16>(q, k, v, out, lse, dout, dq, dk, dv, s, kvh, hq, hkv, d, causal, scale, p, ds);
  } else {
    bwd_rows<0>(q, k, v, out, lse, dout, dq, dk, dv, s, kvh, hq, hkv, d, causal, scale, p, ds);
  }
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  for (const auto* t : {&q, &k, &v}) {
    MVLM_CHECK_VALUE(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3,
                     "attention (csrc): q / k / v must be contiguous float32 CPU [T, H, D] tensors");
  }
  MVLM_CHECK_VALUE(k.sizes() == v.sizes() && q.size(2) == k.size(2) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
                   "attention (csrc): k / v [Tk, Hkv, D] with Hkv dividing q's heads and q's head dim");
  MVLM_CHECK_VALUE(q.size(2) % 8 == 0 && q.size(2) <= kMaxHeadDim, "attention (csrc): head dim must be a multiple "
                   "of 8 and <= ", kMaxHeadDim);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> varlen_attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v, const at::Tensor& cu_q,
                                                            const at::Tensor& cu_k, bool causal, double scale) {
  check_qkv(q, k, v);
  const auto samples = samples_of(cu_q, cu_k, q.size(0), k.size(0));
  const int64_t hq = q.size(1), hkv = k.size(1), d = q.size(2);
  auto out = at::zeros_like(q);
  auto lse = at::empty({q.size(0), hq}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const int64_t tasks = static_cast<int64_t>(samples.size()) * hkv;
  at::parallel_for(0, tasks, 1, [&](int64_t b, int64_t e) {
    std::vector<int64_t> rows;
    std::vector<float> scores;
    for (int64_t t = b; t < e; ++t) {
      fwd_task(qp, kp, vp, op, lp, samples[t / hkv], t % hkv, hq, hkv, d, causal, static_cast<float>(scale), rows,
               scores);
    }
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_bwd_cpu(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_q, const at::Tensor& cu_k, bool causal, double scale) {
  check_qkv(q, k, v);
  MVLM_CHECK_VALUE(grad.sizes() == q.sizes() && out.sizes() == q.sizes() && grad.is_contiguous() && out.is_contiguous() &&
                       grad.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && lse.is_contiguous() &&
                       lse.numel() == q.size(0) * q.size(1),
                   "attention (csrc) backward: grad / out like q, lse [Tq, Hq]");
  const auto samples = samples_of(cu_q, cu_k, q.size(0), k.size(0));
  const int64_t hq = q.size(1), hkv = k.size(1), d = q.size(2);
  auto dq = at::zeros_like(q);
  auto dk = at::zeros_like(k);
  auto dv = at::zeros_like(v);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* op = out.data_ptr<float>();
  const float* lp = lse.data_ptr<float>();
  const float* gp = grad.data_ptr<float>();
  float* dqp = dq.data_ptr<float>();
  float* dkp = dk.data_ptr<float>();
  float* dvp = dv.data_ptr<float>();
  const int64_t tasks = static_cast<int64_t>(samples.size()) * hkv;
  at::parallel_for(0, tasks, 1, [&](int64_t b, int64_t e) {
    std::vector<float> scratch;
    for (int64_t t = b; t < e; ++t) {
      bwd_task(qp, kp, vp, op, lp, gp, dqp, dkp, dvp, samples[t / hkv], t % hkv, hq, hkv, d, causal,
               static_cast<float>(scale), scratch);
    }
  });
  return {dq, dk, dv};
}

}  // namespace megatron_vlm
