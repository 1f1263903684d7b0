// megatron_vlm._C: 8-wide vector helpers of the fused CPU kernels (cpu_layer_ops.cpp, cpu_varlen_attention.cpp).
//
// Eight floats as one value (GCC / Clang vector extensions): AVX registers in the AVX2 + FMA clone of a
// kernel (MVLM_CLONES, GCC target_clones on x86-64), SSE pairs in its baseline clone. Everything here is
// inline, so it is compiled into each clone with that clone's instruction set.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MVLM_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define MVLM_CLONES
#endif

namespace megatron_vlm {
namespace cpu_vec {

// Eight floats as one value (GCC / Clang vector extension): AVX registers in the AVX2 clone, SSE pairs in the
// baseline one. Loads and stores go through memcpy (unaligned). Written out rather than left to the
// auto-vectoriser, which turned the rounding and clamps of exp() into slow code (~2x slower measured).
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }

inline v8f splat8(float x) { return v8f{x, x, x, x, x, x, x, x}; }

inline float hsum8(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

#if defined(__clang__)
#define MVLM_SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define MVLM_SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, v8i{__VA_ARGS__})
#endif

// {hsum8(a[0]), ..., hsum8(a[7])} in one value: the same additions in the same order as hsum8 (so the same
// bits), done as three rounds of lane shuffles + adds over all eight vectors at once instead of eight
// horizontal sums (the score loop of decode_attention_rows sums 8 keys' products this way).
inline v8f hsum8x8(const v8f* a) {
  v8f c[4];  // c[i] = (b_{2i}[0..3], b_{2i+1}[0..3]) with b[k] = a[k] + a[k + 4]
  for (int i = 0; i < 4; ++i) {
    c[i] = MVLM_SHUFFLE2(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           MVLM_SHUFFLE2(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  }
  // e = (b0p, b0q, b2p, b2q, b1p, b1q, b3p, b3q) with p = b[0] + b[1], q = b[2] + b[3]; f likewise for 4-7
  const v8f e = MVLM_SHUFFLE2(c[0], c[1], 0, 2, 8, 10, 4, 6, 12, 14) + MVLM_SHUFFLE2(c[0], c[1], 1, 3, 9, 11, 5, 7, 13, 15);
  const v8f f = MVLM_SHUFFLE2(c[2], c[3], 0, 2, 8, 10, 4, 6, 12, 14) + MVLM_SHUFFLE2(c[2], c[3], 1, 3, 9, 11, 5, 7, 13, 15);
  // g = (s0, s2, s4, s6, s1, s3, s5, s7) with s = p + q
  const v8f g = MVLM_SHUFFLE2(e, f, 0, 2, 8, 10, 4, 6, 12, 14) + MVLM_SHUFFLE2(e, f, 1, 3, 9, 11, 5, 7, 13, 15);
  return MVLM_SHUFFLE2(g, g, 0, 4, 1, 5, 2, 6, 3, 7);
}

// exp(x) for x <= 0 (larger x is not passed here): clamp at -87.3 (exp underflows to ~1e-38, never 0 / NaN),
// n = round(x / ln2) (x <= 0: truncating x / ln2 - 0.5), r = x - n ln2 in two parts, exp(r) by a degree-5
// polynomial (|r| <= ln2 / 2), times 2^n built in the exponent bits. Relative error ~2e-7.
// A template over the vector type (8 lanes here; the AVX-512 decode kernels use it with 16), always inlined so it
// is compiled with its caller's instruction set.
template <typename V, typename VI>
__attribute__((always_inline)) inline V vexp_nonpos_t(V x) {
  const V lo = V{} + -87.3f;
  x = x < lo ? lo : x;
  const VI ni = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, VI);
  const V n = __builtin_convertvector(ni, V);
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const V y = p * r * r + r + 1.0f;
  const VI bits = (ni + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

inline v8f vexp_nonpos(v8f x) { return vexp_nonpos_t<v8f, v8i>(x); }

// sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e) for x < 0, with e = exp(-|x|) <= 1 (no overflow).
inline v8f vsigmoid(v8f x) {
  const v8f e = vexp_nonpos(x < splat8(0.0f) ? x : -x);
  const v8f inv = 1.0f / (1.0f + e);
  return x < splat8(0.0f) ? e * inv : inv;
}

// Apply f(i, n8) over [0, n) in 8-wide steps; the last partial step runs on a zero-padded copy, so every
// element goes through the same vector code (results do not depend on an element's position).
template <typename F>
inline void for_each8(int64_t n, F&& f) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) f(i, 8);
  if (i < n) f(i, n - i);
}

inline v8f load_part(const float* p, int64_t k) {
  if (k == 8) return load8(p);
  float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(tmp, p, sizeof(float) * k);
  return load8(tmp);
}

inline void store_part(float* p, v8f v, int64_t k) {
  if (k == 8) return store8(p, v);
  float tmp[8];
  store8(tmp, v);
  std::memcpy(p, tmp, sizeof(float) * k);
}

// ---- attention helpers (decode attention, varlen attention) ----------------------------------------

// s[j] <- exp(s[j] - m) (m = max s), returns their sum (8 partial sums, added in a fixed order).
inline float softmax_numerators(float* s, int64_t n, float m) {
  v8f acc = splat8(0.0f);
  for_each8(n, [&](int64_t j, int64_t k) {
    v8f e = vexp_nonpos(load_part(s + j, k) - m);
    if (k < 8) {  // padding lanes hold exp(0 - m): not part of the sum
      for (int64_t lane = k; lane < 8; ++lane) e[lane] = 0.0f;
    }
    store_part(s + j, e, k);
    acc += e;
  });
  return hsum8(acc);
}

// 8-lane partial products of q . k (two chains over the d / 8 chunks, then added); hsum8 of it is the dot.
template <int64_t kC>
__attribute__((always_inline)) inline v8f dot_parts(const float* q, const float* k, int64_t chunks) {
  const int64_t nc = kC > 0 ? kC : chunks;
  v8f a0 = {0, 0, 0, 0, 0, 0, 0, 0}, a1 = a0;
  int64_t c = 0;
  for (; c + 1 < nc; c += 2) {
    a0 += load8(q + 8 * c) * load8(k + 8 * c);
    a1 += load8(q + 8 * c + 8) * load8(k + 8 * c + 8);
  }
  if (c < nc) a0 += load8(q + 8 * c) * load8(k + 8 * c);
  return a0 + a1;
}

// One (sequence, kv head): the `group` query rows of q (d apart) against `n` keys / values; key j of the
// sequence is row `rows[j]` of the cache (rows d floats apart). kC = d / 8 as a template constant for the
// common head sizes (the query chunks and the output accumulators stay in registers); 0 = runtime d (a
// multiple of 8). Scores: one dot per (key, query) with two accumulators; output: for each key, every
// 8-wide chunk of the output gets p_j * v_j (independent accumulators, no reduction chain).
template <int64_t kC>
__attribute__((always_inline)) inline void decode_attention_rows(const float* q, int64_t q_stride, const float* kc,
                                                                 const float* vc,
                                                                 const int64_t* rows, int64_t n, int64_t group,
                                                                 int64_t d, float scale, float* scores, float* out,
                                                                 float* lse = nullptr) {
  constexpr int64_t kMax = kC > 0 ? kC : 1;
  const int64_t chunks = kC > 0 ? kC : d / 8;
  for (int64_t gq = 0; gq < group; ++gq) {
    const float* qg = q + gq * q_stride;
    float* s = scores + gq * n;
    auto products = [&](int64_t j) { return dot_parts<kC>(qg, kc + rows[j] * d, chunks); };
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {  // 8 keys' sums at once (hsum8x8: the same bits as 8 hsum8 calls)
      v8f parts[8];
      for (int t = 0; t < 8; ++t) parts[t] = products(j + t);
      store8(s + j, hsum8x8(parts) * scale);
    }
    for (; j < n; ++j) s[j] = hsum8(products(j)) * scale;
    float m = s[0];
    for (int64_t j = 1; j < n; ++j) m = std::max(m, s[j]);
    const float sum = softmax_numerators(s, n, m);
    const float inv = 1.0f / sum;
    if (lse != nullptr) lse[gq] = m + std::log(sum);
    float* og = out + gq * d;
    if (kC > 0) {
      v8f acc[kMax];
      for (int64_t c = 0; c < kMax; ++c) acc[c] = v8f{0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t j = 0; j < n; ++j) {
        const float* v = vc + rows[j] * d;
        const float p = s[j];
        for (int64_t c = 0; c < kMax; ++c) acc[c] += p * load8(v + 8 * c);
      }
      for (int64_t c = 0; c < kMax; ++c) store8(og + 8 * c, acc[c] * inv);
    } else {
      for (int64_t i = 0; i < d; ++i) og[i] = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        const float* v = vc + rows[j] * d;
        const float p = s[j];
        for (int64_t c = 0; c < chunks; ++c) store8(og + 8 * c, load8(og + 8 * c) + p * load8(v + 8 * c));
      }
      for (int64_t c = 0; c < chunks; ++c) store8(og + 8 * c, load8(og + 8 * c) * inv);
    }
  }
}

}  // namespace cpu_vec
}  // namespace megatron_vlm
