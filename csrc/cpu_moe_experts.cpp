// Routed MoE experts in one CPU call (inference): permute + first GEMM + activation (SwiGLU) + second GEMM +
// weighted combine, for the built-in engine's fp32 decode step (megatron_vlm/inference/cpu_packed_experts.py).
//
// Why: the module path (models/common/moe.py GroupedExperts: kernels.moe_permute -> two kernels.grouped_mm ->
// activation -> kernels.moe_unpermute) runs ~30 ATen ops per layer, and its per-expert `aten::mm` calls multiply
// a few rows by the plain weight, which MKL re-lays-out on every call. At the decode shape of the tiny
// Qwen3-MoE rollout row (64 tokens, 8 experts, top 2, hidden 256, expert MLP 256) the GEMMs ran at ~40 GFLOP/s
// and the glue took another 60 % on top. Here the glue is a few loops over the pairs, and each expert's GEMMs
// run on a copy of its weights laid out once by MKL's packed-GEMM API (cblas_sgemm_pack, ~1.8x faster per GEMM
// at 16 rows; a packed B matrix serves any row count), when that API is there: MKL is linked into
// libtorch_cpu on x86 builds, and its symbols are taken weakly, so a torch without it loads this library and
// the op multiplies by the plain weights (at::mm) instead.
//
// Numerics: fp32 throughout; results equal the module path to fp32 rounding (another GEMM kernel, a polynomial
// exp in SiLU; MKL picks its kernel by row count, so, as with the module path, a token's rounding may depend on
// how many tokens share its expert); the combine adds a token's k expert outputs in slot order.
#include "cpu_vec.h"
#include "check.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

// MKL's packed-GEMM entry points (LP64 CBLAS, as exported by libtorch_cpu on x86 builds); weak, so they are
// null where torch has no MKL.
extern "C" {
size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k) __attribute__((weak));
void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha, const float* src, int ld,
                      float* dest) __attribute__((weak));
void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc) __attribute__((weak));
}

namespace megatron_vlm {
namespace {

using namespace cpu_vec;  // NOLINT: the vector helpers of this file's activation loops

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;
constexpr int64_t kPackAlign = 64;  // bytes: each expert's packed matrix starts on a cache line

bool mkl_packing() {
  return cblas_sgemm_pack_get_size != nullptr && cblas_sgemm_pack != nullptr && cblas_sgemm_compute != nullptr;
}

// Bytes of one expert's packed [n, k] weight (row-major, used transposed), rounded up to kPackAlign.
int64_t packed_stride(int64_t n, int64_t k) {
  const int64_t bytes = static_cast<int64_t>(cblas_sgemm_pack_get_size(kBMatrix, 16, static_cast<int>(n),
                                                                       static_cast<int>(k)));
  return (bytes + kPackAlign - 1) / kPackAlign * kPackAlign;
}

// Activation codes (kernels/csrc/moe_experts.py ACTIVATIONS): 0 silu, 1 relu2, 2 gelu (erf), 3 gelu (tanh).
MVLM_CLONES void silu_mul_rows(const float* h, int64_t rows, int64_t inter, bool gated, float* mid) {
  // gated: mid = silu(gate) * up with h = [gate | up] per row; else mid = silu(h)
  const int64_t width = gated ? 2 * inter : inter;
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = h + r * width;
    const float* u = g + inter;
    float* o = mid + r * inter;
    for_each8(inter, [&](int64_t i, int64_t k) {
      const v8f x = load_part(g + i, k);
      v8f y = x * vsigmoid(x);
      if (gated) y *= load_part(u + i, k);
      store_part(o + i, y, k);
    });
  }
}

float act_scalar(int64_t code, float x) {
  switch (code) {
    case 1: {
      const float r = x > 0.0f ? x : 0.0f;
      return r * r;
    }
    case 2:
      return 0.5f * x * (1.0f + std::erf(x * static_cast<float>(M_SQRT1_2)));
    default: {  // 3
      const float c = 0.7978845608028654f;  // sqrt(2 / pi)
      return 0.5f * x * (1.0f + std::tanh(c * (x + 0.044715f * x * x * x)));
    }
  }
}

void activation_rows(int64_t code, const float* h, int64_t rows, int64_t inter, bool gated, float* mid) {
  if (code == 0) return silu_mul_rows(h, rows, inter, gated, mid);
  const int64_t width = gated ? 2 * inter : inter;
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = h + r * width;
    float* o = mid + r * inter;
    for (int64_t i = 0; i < inter; ++i) o[i] = gated ? act_scalar(code, g[i]) * g[inter + i] : act_scalar(code, g[i]);
  }
}

// c[m, n] = a[m, k] @ w[n, k]^T on the packed copy of w (cblas_sgemm_pack of moe_pack_expert_weights).
void packed_gemm(const float* a, int64_t m, int64_t k, const uint8_t* packed, float* c, int64_t n) {
  cblas_sgemm_compute(kRowMajor, kNoTrans, kPacked, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), a,
                      static_cast<int>(k), reinterpret_cast<const float*>(packed), static_cast<int>(n), 0.0f, c,
                      static_cast<int>(n));
}

void check_weights(const at::Tensor& w, const char* name) {
  MVLM_CHECK_VALUE(w.dim() == 3, "moe_experts: ", name, " must be [E, out, in], got ", w.sizes());
  MVLM_CHECK_VALUE(w.scalar_type() == at::kFloat && w.device().is_cpu() && w.is_contiguous(), "moe_experts: ", name,
                   " must be a contiguous float32 CPU tensor");
}

const uint8_t* packed_base(const std::optional<at::Tensor>& packed, const at::Tensor& w) {
  if (!packed.has_value() || packed->numel() == 0) return nullptr;
  MVLM_CHECK_VALUE(mkl_packing(), "moe_experts: packed weights given but this torch has no MKL packed GEMM");
  const int64_t stride = packed_stride(w.size(1), w.size(2));
  MVLM_CHECK_VALUE(packed->scalar_type() == at::kByte && packed->dim() == 2 && packed->size(0) == w.size(0) &&
                       packed->size(1) == stride && packed->is_contiguous(),
                   "moe_experts: packed weights must come from moe_pack_expert_weights of the same weight shape");
  return packed->data_ptr<uint8_t>();
}

}  // namespace

at::Tensor moe_pack_expert_weights_cpu(const at::Tensor& w) {
  check_weights(w, "w");
  if (!mkl_packing()) return at::empty({0}, w.options().dtype(at::kByte));
  const int64_t e = w.size(0), n = w.size(1), k = w.size(2);
  const int64_t stride = packed_stride(n, k);
  // Raw memory rather than at::empty: MKL writes only part of its reservation, and at::empty fills the whole
  // buffer when torch's deterministic mode asks uninitialised memory to be filled (the pages would all be touched).
  void* raw = nullptr;
  MVLM_CHECK(posix_memalign(&raw, kPackAlign, static_cast<size_t>(e * stride)) == 0 || e * stride == 0,
             "moe_pack_expert_weights: cannot reserve ", e * stride, " bytes");
  at::Tensor out = at::from_blob(raw, {e, stride}, [](void* p) { std::free(p); }, w.options().dtype(at::kByte));
  const float* src = w.data_ptr<float>();
  uint8_t* dst = static_cast<uint8_t*>(raw);
  for (int64_t i = 0; i < e; ++i) {
    cblas_sgemm_pack(kRowMajor, kBMatrix, kTrans, 16, static_cast<int>(n), static_cast<int>(k), 1.0f,
                     src + i * n * k, static_cast<int>(k), reinterpret_cast<float*>(dst + i * stride));
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> moe_experts_cpu(const at::Tensor& x, const at::Tensor& topk_ids,
                                                   const at::Tensor& topk_weights, const at::Tensor& w1,
                                                   const at::Tensor& w2, const std::optional<at::Tensor>& w1_packed,
                                                   const std::optional<at::Tensor>& w2_packed, bool gated,
                                                   int64_t activation) {
  MVLM_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
                   "moe_experts: x must be a contiguous float32 [N, H] tensor");
  MVLM_CHECK_VALUE(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) && topk_ids.scalar_type() == at::kLong &&
                       topk_ids.is_contiguous(),
                   "moe_experts: topk_ids must be contiguous int64 [N, k], got ", topk_ids.sizes());
  MVLM_CHECK_VALUE(topk_weights.sizes() == topk_ids.sizes() && topk_weights.scalar_type() == at::kFloat &&
                       topk_weights.is_contiguous(),
                   "moe_experts: topk_weights must be contiguous float32 of topk_ids' shape");
  check_weights(w1, "w1");
  check_weights(w2, "w2");
  MVLM_CHECK_VALUE(activation >= 0 && activation <= 3, "moe_experts: unknown activation code ", activation);
  const int64_t n_tok = x.size(0), topk = topk_ids.size(1), hidden = x.size(1), experts = w1.size(0);
  const int64_t width = w1.size(1), inter = gated ? width / 2 : width;
  MVLM_CHECK_VALUE(w1.size(2) == hidden, "moe_experts: w1 ", w1.sizes(), " does not take hidden ", hidden);
  MVLM_CHECK_VALUE(!gated || width % 2 == 0, "moe_experts: a gated w1 needs an even output size");
  MVLM_CHECK_VALUE(w2.size(0) == experts && w2.size(1) == hidden && w2.size(2) == inter, "moe_experts: w2 ",
                   w2.sizes(), " must be [", experts, ", ", hidden, ", ", inter, "]");
  const uint8_t* p1 = packed_base(w1_packed, w1);
  const uint8_t* p2 = packed_base(w2_packed, w2);
  const int64_t s1 = p1 != nullptr ? packed_stride(width, hidden) : 0;
  const int64_t s2 = p2 != nullptr ? packed_stride(hidden, inter) : 0;

  // Pairs grouped by expert (counting sort, stable: an expert's pairs keep the order t * k + j).
  const int64_t pairs = n_tok * topk;
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  at::Tensor counts = at::zeros({experts}, topk_ids.options());
  int64_t* cnt = counts.data_ptr<int64_t>();
  for (int64_t i = 0; i < pairs; ++i) {
    MVLM_CHECK_VALUE(ids[i] >= 0 && ids[i] < experts, "moe_experts: expert id ", ids[i], " not in [0, ", experts, ")");
    ++cnt[ids[i]];
  }
  std::vector<int64_t> start(experts + 1, 0), fill(experts);
  for (int64_t e = 0; e < experts; ++e) start[e + 1] = start[e] + cnt[e];
  for (int64_t e = 0; e < experts; ++e) fill[e] = start[e];
  std::vector<int64_t> row_of_pair(pairs);
  at::Tensor xp = at::empty({pairs, hidden}, x.options());
  const float* xs = x.data_ptr<float>();
  float* xd = xp.data_ptr<float>();
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t r = fill[ids[i]]++;
    row_of_pair[i] = r;
    std::memcpy(xd + r * hidden, xs + (i / topk) * hidden, sizeof(float) * hidden);
  }

  at::Tensor h = at::empty({pairs, width}, x.options());
  at::Tensor mid = at::empty({pairs, inter}, x.options());
  at::Tensor y = at::empty({pairs, hidden}, x.options());
  float* hd = h.data_ptr<float>();
  float* md = mid.data_ptr<float>();
  float* yd = y.data_ptr<float>();
  auto run_expert = [&](int64_t e) {
    const int64_t r0 = start[e], m = start[e + 1] - r0;
    if (m == 0) return;
    if (p1 != nullptr) {
      packed_gemm(xd + r0 * hidden, m, hidden, p1 + e * s1, hd + r0 * width, width);
    } else {
      at::Tensor h_rows = h.narrow(0, r0, m);
      at::mm_out(h_rows, xp.narrow(0, r0, m), w1[e].t());
    }
    activation_rows(activation, hd + r0 * width, m, inter, gated, md + r0 * inter);
    if (p2 != nullptr) {
      packed_gemm(md + r0 * inter, m, inter, p2 + e * s2, yd + r0 * hidden, hidden);
    } else {
      at::Tensor y_rows = y.narrow(0, r0, m);
      at::mm_out(y_rows, mid.narrow(0, r0, m), w2[e].t());
    }
  };
  if (p1 != nullptr && p2 != nullptr) {  // raw MKL calls: one task per expert
    at::parallel_for(0, experts, 1, [&](int64_t e0, int64_t e1) {
      for (int64_t e = e0; e < e1; ++e) run_expert(e);
    });
  } else {  // ATen calls (they thread themselves, and need this thread's dispatch state, e.g. inference mode)
    for (int64_t e = 0; e < experts; ++e) run_expert(e);
  }

  // out[t] = sum_j w[t, j] * y[row of pair t * k + j], slot order
  at::Tensor out = at::empty({n_tok, hidden}, x.options());
  float* od = out.data_ptr<float>();
  const float* wts = topk_weights.data_ptr<float>();
  at::parallel_for(0, n_tok, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = od + t * hidden;
      for (int64_t j = 0; j < topk; ++j) {
        const float wj = wts[t * topk + j];
        const float* src = yd + row_of_pair[t * topk + j] * hidden;
        if (j == 0) {
          for (int64_t c = 0; c < hidden; ++c) o[c] = wj * src[c];
        } else {
          for (int64_t c = 0; c < hidden; ++c) o[c] += wj * src[c];
        }
      }
    }
  });
  return {out, counts};
}

}  // namespace megatron_vlm
