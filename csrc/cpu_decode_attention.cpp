// CPU decode attention: one query token per sequence against its cached keys (slot or paged KV cache).
//
// Why this shape of loop: a decode step reads every cached key and value once and does ~4 flops per float
// read, so the kernel is bound by how it walks the cache. The cache is position-major
// ([slots or blocks, length, Hkv, D]: one position's kv heads side by side), so a task takes a whole
// sequence (all its kv heads; only when there are too few sequences for the threads does it take one kv
// head) and walks its positions in order, in blocks of keys that fit in L1 (~16 KB). Inside a block every
// query head of every GQA group reads the block's keys (then values) from L1: each K / V row comes from
// memory once per step, in address order, instead of once per query head from a strided walk (the kernel
// before this one read one row per position and kv head, `group` times, ~3x slower at the rollout rows'
// shape: 12 / 2 heads of 64, ~575 positions, 32 sequences).
//
// Prefetch: the hardware streams the cache from memory no faster than ~9 GB/s on one core, and it does not overlap
// those loads with the arithmetic by itself (measured: the kernel from memory took the sum of its in-cache time
// and a plain read of the same bytes). So the first pass over each block's rows (the first query heads of the
// task's first kv head) also prefetches the rows kPrefetchKeys positions ahead, all the task's kv heads of each:
// ~22 % less time from memory at the rollout shapes (32 sequences x 12 / 2 heads x 64, 575 and 1000 keys).
//
// Shared prompts (decode_attention_prefix, at the end): the G samples of one prompt read its keys once, all
// their query heads together; that group task runs the head-major kernel (attend_many16) on AVX-512.
//
// Numerics (decode_attention): two passes per query head, as before (scores, max, exp / sum, then values), with the same
// arithmetic in the same order for each (query head, key): the 8-lane partial dot products summed by
// hsum8x8 / hsum8, the same softmax_numerators, and the output accumulated key by key from zero (kept in
// registers within a block, in the output row between blocks: a store and a load are exact). The result is
// therefore bitwise the one of the previous kernel, independent of the block size, the batch a sequence
// comes in and the thread count. decode_attention_prefix promises only fp32 rounding against it (a split
// softmax; its result for a row depends on whether other rows of its group share the step, never on threads).
#include "cpu_vec.h"
#include "check.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace megatron_vlm {
namespace {

using namespace cpu_vec;  // NOLINT: the vector helpers of this file's kernels

constexpr int64_t kBlockBytes = 16384;  // K (or V) bytes of one block of keys, all the task's kv heads
constexpr int64_t kPrefetchKeys = 8;     // how far ahead (in positions) the rows are prefetched; 4-12 measured alike

// What a block pass prefetches: the rows of key j + kPrefetchKeys at base + rows[j + kPrefetchKeys] * d, `lines`
// 64-byte lines each (base null: nothing). rows[] is padded past n so the look-ahead stays in bounds.
struct Prefetch {
  const float* base;
  int64_t lines;
  __attribute__((always_inline)) inline void row(const int64_t* rows, int64_t j, int64_t d) const {
    if (base == nullptr) return;
    const float* p = base + rows[j + kPrefetchKeys] * d;
    for (int64_t c = 0; c < lines; ++c) __builtin_prefetch(p + 16 * c, 0, 3);
  }
};


// max(s[0], ..., s[n - 1]) (n >= 1) over 8 lanes: the same value as a scalar left-to-right max (a max does not
// round), without its n-long chain of dependent compares.
__attribute__((always_inline)) inline float max_of(const float* s, int64_t n) {
  v8f m = splat8(s[0]);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const v8f x = load8(s + j);
    m = x > m ? x : m;
  }
  float r = m[0];
  for (int i = 1; i < 8; ++i) r = std::max(r, m[i]);
  for (; j < n; ++j) r = std::max(r, s[j]);
  return r;
}

// s[j] = (q . k_j) * scale for keys j in [j0, j1); key j at kc + rows[j] * d.
template <int64_t kC>
__attribute__((always_inline)) inline void score_block(const float* q, const float* kc, const int64_t* rows, int64_t j0,
                                                       int64_t j1, int64_t d, int64_t chunks, float scale, float* s,
                                                       Prefetch pf) {
  int64_t j = j0;
  for (; j + 8 <= j1; j += 8) {  // 8 keys' sums at once (hsum8x8: the same bits as 8 hsum8 calls)
    v8f parts[8];
    for (int t = 0; t < 8; ++t) {
      pf.row(rows, j + t, d);
      parts[t] = dot_parts<kC>(q, kc + rows[j + t] * d, chunks);
    }
    store8(s + j, hsum8x8(parts) * scale);
  }
  for (; j < j1; ++j) {
    pf.row(rows, j, d);
    s[j] = hsum8(dot_parts<kC>(q, kc + rows[j] * d, chunks)) * scale;
  }
}

// o += sum_j p[j] v_j over keys j in [j0, j1), key by key (value j at vc + rows[j] * d).
template <int64_t kC>
__attribute__((always_inline)) inline void value_block(const float* p, const float* vc, const int64_t* rows, int64_t j0,
                                                       int64_t j1, int64_t d, int64_t chunks, float* o, Prefetch pf) {
  if constexpr (kC > 0) {
    v8f acc[kC];
    for (int64_t c = 0; c < kC; ++c) acc[c] = load8(o + 8 * c);
    for (int64_t j = j0; j < j1; ++j) {
      pf.row(rows, j, d);
      const float* v = vc + rows[j] * d;
      const float pj = p[j];
      for (int64_t c = 0; c < kC; ++c) acc[c] += pj * load8(v + 8 * c);
    }
    for (int64_t c = 0; c < kC; ++c) store8(o + 8 * c, acc[c]);
  } else {
    for (int64_t j = j0; j < j1; ++j) {
      pf.row(rows, j, d);
      const float* v = vc + rows[j] * d;
      const float pj = p[j];
      for (int64_t c = 0; c < chunks; ++c) store8(o + 8 * c, load8(o + 8 * c) + pj * load8(v + 8 * c));
    }
  }
}

// Each of the `heads` score rows (n floats apart) becomes its softmax numerators in place; inv[h] = 1 / their sum,
// and the row's statistics for a caller that merges partial softmaxes (the shared-prefix op): inv[heads + h] its
// max, inv[2 * heads + h] its sum (so inv holds 3 * heads floats).
__attribute__((always_inline)) inline void softmax_rows(float* scores, float* inv, int64_t heads, int64_t n) {
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores + h * n;
    const float m = max_of(s, n), sum = softmax_numerators(s, n, m);
    inv[h] = 1.0f / sum;
    inv[heads + h] = m;
    inv[2 * heads + h] = sum;
  }
}

// One sequence, kv heads [h0, h1): q rows of query head h at q + h * q_stride, output rows (zeros on entry)
// at out + h * d (h counted from h0 * group); key / value j of kv head g at kc / vc + (rows[j] + g) * d.
// scores holds (h1 - h0) * group * n floats, inv 3 * (h1 - h0) * group (softmax_rows).
template <int64_t kC>
__attribute__((always_inline)) inline void attend_sequence(const float* q, int64_t q_stride, const float* kc,
                                                           const float* vc, const int64_t* rows, int64_t n,
                                                           int64_t h0, int64_t h1, int64_t group, int64_t d,
                                                           float scale, float* scores, float* inv, float* out) {
  const int64_t chunks = d / 8, heads = (h1 - h0) * group, lines = (h1 - h0) * d / 16;
  const int64_t block = std::max<int64_t>(8, kBlockBytes / (4 * d * (h1 - h0)) / 8 * 8);
  for (int64_t j0 = 0; j0 < n; j0 += block) {
    const int64_t j1 = std::min(n, j0 + block);
    for (int64_t g = h0, h = 0; g < h1; ++g) {
      for (int64_t e = 0; e < group; ++e, ++h) {
        const Prefetch pf{h == 0 ? kc + h0 * d : nullptr, lines};
        score_block<kC>(q + h * q_stride, kc + g * d, rows, j0, j1, d, chunks, scale, scores + h * n, pf);
      }
    }
  }
  softmax_rows(scores, inv, heads, n);
  for (int64_t j0 = 0; j0 < n; j0 += block) {
    const int64_t j1 = std::min(n, j0 + block);
    for (int64_t g = h0, h = 0; g < h1; ++g) {
      for (int64_t e = 0; e < group; ++e, ++h) {
        const Prefetch pf{h == 0 ? vc + h0 * d : nullptr, lines};
        value_block<kC>(scores + h * n, vc + g * d, rows, j0, j1, d, chunks, out + h * d, pf);
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* o = out + h * d;
    const v8f f = splat8(inv[h]);
    for (int64_t c = 0; c < chunks; ++c) store8(o + 8 * c, load8(o + 8 * c) * f);
  }
}

// The same in plain loops for a head dim that is not a multiple of 8 (one query head at a time).
void attend_sequence_any(const float* q, int64_t q_stride, const float* kc, const float* vc, const int64_t* rows,
                         int64_t n, int64_t h0, int64_t h1, int64_t group, int64_t d, float scale, float* scores,
                         float* inv, float* out) {
  const int64_t heads = (h1 - h0) * group;
  for (int64_t h = 0; h < heads; ++h) {
    const float* qh = q + h * q_stride;
    const int64_t g = h0 + h / group;
    float* s = scores + h * n;
    for (int64_t j = 0; j < n; ++j) {
      const float* k = kc + (rows[j] + g) * d;
      float dot = 0.0f;
      for (int64_t i = 0; i < d; ++i) dot += qh[i] * k[i];
      s[j] = dot * scale;
    }
    float m = s[0];
    for (int64_t j = 1; j < n; ++j) m = std::max(m, s[j]);
    const float sum = softmax_numerators(s, n, m);
    inv[h] = 1.0f / sum, inv[heads + h] = m, inv[2 * heads + h] = sum;  // as softmax_rows
    float* o = out + h * d;
    for (int64_t j = 0; j < n; ++j) {
      const float* v = vc + (rows[j] + g) * d;
      for (int64_t i = 0; i < d; ++i) o[i] += s[j] * v[i];
    }
    const float r = 1.0f / sum;
    for (int64_t i = 0; i < d; ++i) o[i] *= r;
  }
}

MVLM_CLONES void attend_task(const float* q, int64_t q_stride, const float* kc, const float* vc, const int64_t* rows,
                             int64_t n, int64_t h0, int64_t h1, int64_t group, int64_t d, float scale, float* scores,
                             float* inv, float* out) {
  switch (d) {  // register-resident query chunks / output accumulators for the common head sizes
    case 32: return attend_sequence<4>(q, q_stride, kc, vc, rows, n, h0, h1, group, d, scale, scores, inv, out);
    case 64: return attend_sequence<8>(q, q_stride, kc, vc, rows, n, h0, h1, group, d, scale, scores, inv, out);
    case 128: return attend_sequence<16>(q, q_stride, kc, vc, rows, n, h0, h1, group, d, scale, scores, inv, out);
    default: break;
  }
  if (d % 8 == 0) return attend_sequence<0>(q, q_stride, kc, vc, rows, n, h0, h1, group, d, scale, scores, inv, out);
  attend_sequence_any(q, q_stride, kc, vc, rows, n, h0, h1, group, d, scale, scores, inv, out);
}

// Scratch floats of the head-major path (attend_many16 below): queries transposed, 16 keys, key-major scores.
inline int64_t many_buffer_floats(int64_t heads, int64_t n, int64_t d) { return (heads + 15) / 16 * 16 * (d + n) + 16 * d; }

// ---- AVX-512 (x86-64-v4) path: 16-float vectors, several query heads of a GQA group per pass ----------
//
// Used when the CPU has AVX-512 (and ATEN_CPU_CAPABILITY does not ask for avx2 / default, so the CI rerun
// under ATEN_CPU_CAPABILITY=avx2 exercises the 8-wide path). Same two passes and blocks as above; per
// (query head, key) the dot product is one 16-lane chain over d / 16 chunks (its halves added, then the
// 8-lane hsum), and each key / value row is loaded once for up to kQH (scores) / kVH (values) query heads of
// its group, whose accumulators stay in the 32 vector registers. The sums are the 8-wide path's, bit for bit:
// lanes 0-7 of a 16-lane chain are that path's even-chunk chain (a0), lanes 8-15 its odd-chunk chain (a1),
// and fold16 adds them as it does; each output lane accumulates the same products in the same key order.
// (Not so the head-major kernel of the shared-prefix op, attend_many16: its own order, within fp32 rounding.)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MVLM_HAVE_AVX512_PATH 1
#define MVLM_AVX512 __attribute__((target("arch=x86-64-v4")))

typedef float v16f __attribute__((vector_size(64)));

__attribute__((always_inline)) inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

__attribute__((always_inline)) inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof(v)); }

__attribute__((always_inline)) inline v8f fold16(v16f a) {  // lanes i + lanes i + 8
  v8f lo, hi;
  std::memcpy(&lo, &a, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&a) + sizeof(lo), sizeof(hi));
  return lo + hi;
}

// Scores of H query heads (rows q + h * q_stride) for keys [j0, j1): s[h * n + j].
template <int kC, int H>
__attribute__((always_inline)) inline void score_heads16(const float* q, int64_t q_stride, const float* kc,
                                                         const int64_t* rows, int64_t j0, int64_t j1, int64_t d,
                                                         float scale, float* s, int64_t n, Prefetch pf) {
  v16f qv[H][kC];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < kC; ++c) qv[h][c] = load16(q + h * q_stride + 16 * c);
  auto dots = [&](const float* k, v16f* acc) {
    for (int h = 0; h < H; ++h) acc[h] = v16f{} ;
    for (int c = 0; c < kC; ++c) {
      const v16f kv = load16(k + 16 * c);
      for (int h = 0; h < H; ++h) acc[h] += qv[h][c] * kv;
    }
  };
  int64_t j = j0;
  for (; j + 8 <= j1; j += 8) {
    v8f parts[H][8];
    for (int t = 0; t < 8; ++t) {
      pf.row(rows, j + t, d);
      v16f acc[H];
      dots(kc + rows[j + t] * d, acc);
      for (int h = 0; h < H; ++h) parts[h][t] = fold16(acc[h]);
    }
    for (int h = 0; h < H; ++h) store8(s + h * n + j, hsum8x8(parts[h]) * scale);
  }
  for (; j < j1; ++j) {
    pf.row(rows, j, d);
    v16f acc[H];
    dots(kc + rows[j] * d, acc);
    for (int h = 0; h < H; ++h) s[h * n + j] = hsum8(fold16(acc[h])) * scale;
  }
}

// o[h] += sum_j p[h * n + j] v_j for H query heads over keys [j0, j1) (outputs o + h * d).
template <int kC, int H>
__attribute__((always_inline)) inline void value_heads16(const float* p, int64_t n, const float* vc, const int64_t* rows,
                                                         int64_t j0, int64_t j1, int64_t d, float* o, Prefetch pf) {
  v16f acc[H][kC];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < kC; ++c) acc[h][c] = load16(o + h * d + 16 * c);
  for (int64_t j = j0; j < j1; ++j) {
    pf.row(rows, j, d);
    const float* v = vc + rows[j] * d;
    v16f vv[kC];
    for (int c = 0; c < kC; ++c) vv[c] = load16(v + 16 * c);
    for (int h = 0; h < H; ++h) {
      const float pj = p[h * n + j];
      for (int c = 0; c < kC; ++c) acc[h][c] += pj * vv[c];
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < kC; ++c) store16(o + h * d + 16 * c, acc[h][c]);
}

typedef int v16i __attribute__((vector_size(64)));

// exp(x) for x <= 0, 16 lanes: vexp_nonpos's polynomial lane for lane (the same value per element).
__attribute__((always_inline)) inline v16f vexp16_nonpos(v16f x) { return vexp_nonpos_t<v16f, v16i>(x); }

// ---- many query heads per key (the shared-prefix op: all the rows of a group against one copy) ----------
//
// Head-major: the vector lanes run over 16 query heads, so nothing is ever summed across lanes. The queries
// are transposed once (qt: D rows of hp heads, hp = heads rounded up to 16, zero queries in the padding); 16
// keys at a time are copied into kb (contiguous, so every broadcast is an offset from one register) and their
// scores for a 16-head chunk are 16 accumulators of D FMAs each; the scores s are key-major ([n][hp]), so the
// softmax is per lane (max, exp, sum over keys) and the value pass broadcasts p from one row per key. The sums:
// a score is the D products added in order; the softmax sum per head adds its keys in order.

// s[j][16c .. 16c + 15] = scale * (q . k_j) for keys [j, j + cnt) and one 16-head chunk; kb holds the keys.
template <int D>
__attribute__((always_inline)) inline void many_scores(const float* qt, int64_t hp, int64_t c, const float* kb,
                                                       int64_t cnt, float scale, float* s) {
  v16f acc[16];
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) acc[t] = v16f{};
  for (int dd = 0; dd < D; ++dd) {
    const v16f qv = load16(qt + dd * hp + 16 * c);
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) acc[t] += qv * kb[t * D + dd];
  }
  for (int64_t t = 0; t < cnt; ++t) store16(s + t * hp + 16 * c, acc[t] * scale);
}

// o[h] += sum_j s[j][h0 + h] v_j for HB heads over keys [j0, j1) (outputs o + h * D, accumulated in registers).
template <int kC, int HB>
__attribute__((always_inline)) inline void many_values(const float* s, int64_t hp, int64_t h0, const float* vc,
                                                       const int64_t* rows, int64_t j0, int64_t j1, float* o,
                                                       Prefetch pf) {
  constexpr int D = 16 * kC;
  v16f acc[HB][kC];
#pragma GCC unroll 16
  for (int h = 0; h < HB; ++h)
#pragma GCC unroll 8
    for (int c = 0; c < kC; ++c) acc[h][c] = load16(o + h * D + 16 * c);
  for (int64_t j = j0; j < j1; ++j) {
    pf.row(rows, j, D);
    const float* v = vc + rows[j] * D;
    const float* p = s + j * hp + h0;
    v16f vv[kC];
#pragma GCC unroll 8
    for (int c = 0; c < kC; ++c) vv[c] = load16(v + 16 * c);
#pragma GCC unroll 16
    for (int h = 0; h < HB; ++h) {
      const float pj = p[h];
#pragma GCC unroll 8
      for (int c = 0; c < kC; ++c) acc[h][c] += pj * vv[c];
    }
  }
#pragma GCC unroll 16
  for (int h = 0; h < HB; ++h)
#pragma GCC unroll 8
    for (int c = 0; c < kC; ++c) store16(o + h * D + 16 * c, acc[h][c]);
}

// `heads` query heads (q: rows D apart) of one kv head (kc / vc: its keys / values at rows[j] * D) over n >= 1
// keys: normalised outputs at out + h * D (zeros on entry), 1 / sum, max and sum of head h at inv[h], mx[h],
// sm[h]. buf: many_buffer_floats(heads, n, D) floats.

template <int kC>
__attribute__((always_inline)) inline void attend_many16(const float* q, int64_t heads, const float* kc, const float* vc,
                                                         const int64_t* rows, int64_t n, float scale, float* buf,
                                                         float* inv, float* mx, float* sm, float* out, Prefetch pfk,
                                                         Prefetch pfv) {
  constexpr int D = 16 * kC;
  constexpr int HB = kC <= 2 ? 12 : (kC <= 4 ? 6 : 2);  // heads per value pass: <= 24 accumulators
  const int64_t hp = (heads + 15) / 16 * 16, chunks = hp / 16;
  float* qt = buf;              // [D][hp]
  float* kb = qt + D * hp;      // [16][D]
  float* s = kb + 16 * D;       // [n][hp]
  for (int dd = 0; dd < D; ++dd)
    for (int64_t h = 0; h < hp; ++h) qt[dd * hp + h] = h < heads ? q[h * D + dd] : 0.0f;
  for (int64_t j = 0; j < n; j += 16) {
    const int64_t cnt = std::min<int64_t>(16, n - j);
    for (int64_t t = 0; t < 16; ++t) {  // missing keys of a last partial block: copies of its last key (not stored)
      pfk.row(rows, j + std::min(t, cnt - 1), D);
      const float* k = kc + rows[j + std::min(t, cnt - 1)] * D;
#pragma GCC unroll 8
      for (int c = 0; c < kC; ++c) store16(kb + t * D + 16 * c, load16(k + 16 * c));
    }
    for (int64_t c = 0; c < chunks; ++c) many_scores<D>(qt, hp, c, kb, cnt, scale, s + j * hp);
  }
  for (int64_t c = 0; c < chunks; ++c) {  // softmax per head (lane): max, then exp and the sum over the keys
    v16f m = load16(s + 16 * c);
    for (int64_t j = 1; j < n; ++j) {
      const v16f x = load16(s + j * hp + 16 * c);
      m = x > m ? x : m;
    }
    v16f sum{};
    for (int64_t j = 0; j < n; ++j) {
      const v16f e = vexp16_nonpos(load16(s + j * hp + 16 * c) - m);
      store16(s + j * hp + 16 * c, e);
      sum += e;
    }
    for (int64_t l = 0; l < 16 && 16 * c + l < heads; ++l) {
      const int64_t h = 16 * c + l;
      inv[h] = 1.0f / sum[l], mx[h] = m[l], sm[h] = sum[l];
    }
  }
  const int64_t block = 64;  // keys per value block: their rows stay in L1 across the head blocks
  for (int64_t j0 = 0; j0 < n; j0 += block) {
    const int64_t j1 = std::min(n, j0 + block);
    int64_t h = 0;
    for (; h + HB <= heads; h += HB) {
      many_values<kC, HB>(s, hp, h, vc, rows, j0, j1, out + h * D, h == 0 ? pfv : Prefetch{nullptr, 0});
    }
    for (; h < heads; ++h) many_values<kC, 1>(s, hp, h, vc, rows, j0, j1, out + h * D, h == 0 ? pfv : Prefetch{nullptr, 0});
  }
  for (int64_t h = 0; h < heads; ++h) {
    const v16f f = v16f{} + inv[h];
    for (int c = 0; c < kC; ++c) store16(out + h * D + 16 * c, load16(out + h * D + 16 * c) * f);
  }
}

template <int kC>
__attribute__((always_inline)) inline void attend_sequence16(const float* q, int64_t q_stride, const float* kc,
                                                             const float* vc, const int64_t* rows, int64_t n,
                                                             int64_t h0, int64_t h1, int64_t group, int64_t d,
                                                             float scale, float* scores, float* inv, float* out,
                                                             bool many) {
  constexpr int kQH = kC <= 4 ? 2 : 1;                     // query heads per score pass
  constexpr int kVH = kC <= 2 ? 6 : (kC <= 4 ? 6 : 2);     // query heads per value pass (<= 28 accumulators)
  const int64_t heads = (h1 - h0) * group, lines = (h1 - h0) * d / 16;
  if (many && q_stride == d) {  // head-major, one kv head at a time (scores: many_buffer_floats(group, n, d))
    for (int64_t g = h0, h = 0; g < h1; ++g, h += group) {
      const Prefetch pfk{g == h0 ? kc + h0 * d : nullptr, lines}, pfv{g == h0 ? vc + h0 * d : nullptr, lines};
      attend_many16<kC>(q + h * d, group, kc + g * d, vc + g * d, rows, n, scale, scores, inv + h, inv + heads + h,
                        inv + 2 * heads + h, out + h * d, pfk, pfv);
    }
    return;
  }
  const int64_t block = std::max<int64_t>(8, kBlockBytes / (4 * d * (h1 - h0)) / 8 * 8);
  for (int64_t j0 = 0; j0 < n; j0 += block) {
    const int64_t j1 = std::min(n, j0 + block);
    for (int64_t g = h0, h = 0; g < h1; ++g) {
      for (int64_t e = 0; e < group;) {
        const float* qh = q + h * q_stride;
        const Prefetch pf{h == 0 ? kc + h0 * d : nullptr, lines};
        if (group - e >= kQH) {
          score_heads16<kC, kQH>(qh, q_stride, kc + g * d, rows, j0, j1, d, scale, scores + h * n, n, pf);
          e += kQH, h += kQH;
        } else {
          score_heads16<kC, 1>(qh, q_stride, kc + g * d, rows, j0, j1, d, scale, scores + h * n, n, pf);
          e += 1, h += 1;
        }
      }
    }
  }
  softmax_rows(scores, inv, heads, n);
  for (int64_t j0 = 0; j0 < n; j0 += block) {
    const int64_t j1 = std::min(n, j0 + block);
    for (int64_t g = h0, h = 0; g < h1; ++g) {
      for (int64_t e = 0; e < group;) {
        const int64_t left = std::min<int64_t>(group - e, kVH);
        const float* p = scores + h * n;
        const float* v = vc + g * d;
        float* o = out + h * d;
        const Prefetch pf{h == 0 ? vc + h0 * d : nullptr, lines};
        switch (left) {
          case 6: value_heads16<kC, (kVH >= 6 ? 6 : 1)>(p, n, v, rows, j0, j1, d, o, pf); break;
          case 5: value_heads16<kC, (kVH >= 5 ? 5 : 1)>(p, n, v, rows, j0, j1, d, o, pf); break;
          case 4: value_heads16<kC, (kVH >= 4 ? 4 : 1)>(p, n, v, rows, j0, j1, d, o, pf); break;
          case 3: value_heads16<kC, (kVH >= 3 ? 3 : 1)>(p, n, v, rows, j0, j1, d, o, pf); break;
          case 2: value_heads16<kC, 2>(p, n, v, rows, j0, j1, d, o, pf); break;
          default: value_heads16<kC, 1>(p, n, v, rows, j0, j1, d, o, pf); break;
        }
        const int64_t done = left >= 2 && left <= kVH ? left : 1;
        e += done, h += done;
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* o = out + h * d;
    const v16f f = v16f{} + inv[h];
    for (int c = 0; c < kC; ++c) store16(o + 16 * c, load16(o + 16 * c) * f);
  }
}

// The AVX-512 task; false when d has no 16-wide kernel here (the caller then runs attend_task).
MVLM_AVX512 bool attend_task16(const float* q, int64_t q_stride, const float* kc, const float* vc, const int64_t* rows,
                               int64_t n, int64_t h0, int64_t h1, int64_t group, int64_t d, float scale, float* scores,
                               float* inv, float* out, bool many) {
  switch (d) {
    case 32: attend_sequence16<2>(q, q_stride, kc, vc, rows, n, h0, h1, group, d, scale, scores, inv, out, many);
      return true;
    case 64: attend_sequence16<4>(q, q_stride, kc, vc, rows, n, h0, h1, group, d, scale, scores, inv, out, many);
      return true;
    case 128: attend_sequence16<8>(q, q_stride, kc, vc, rows, n, h0, h1, group, d, scale, scores, inv, out, many);
      return true;
    default: return false;
  }
}

bool use_avx512_path() {
  static const bool on = [] {
    const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
    if (cap != nullptr && (std::strcmp(cap, "avx2") == 0 || std::strcmp(cap, "default") == 0)) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw");
  }();
  return on;
}
#else
bool use_avx512_path() { return false; }
bool attend_task16(const float*, int64_t, const float*, const float*, const int64_t*, int64_t, int64_t, int64_t,
                   int64_t, int64_t, float, float*, float*, float*, bool) {
  return false;
}
#endif

// One task's attention on the widest kernel this CPU and head dim have (`many`: a large GQA group with query rows d
// apart, the shared-prefix op's; head-major on the AVX-512 kernels, whose scores buffer then needs
// many_buffer_floats(group, n, d) floats).
void attend(bool wide, const float* q, int64_t q_stride, const float* kc, const float* vc, const int64_t* rows,
            int64_t n, int64_t h0, int64_t h1, int64_t group, int64_t d, float scale, float* scores, float* inv,
            float* out, bool many = false) {
  if (!(wide && attend_task16(q, q_stride, kc, vc, rows, n, h0, h1, group, d, scale, scores, inv, out, many))) {
    attend_task(q, q_stride, kc, vc, rows, n, h0, h1, group, d, scale, scores, inv, out);
  }
}

void check_q_and_caches(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& cache_seqlens) {
  MVLM_CHECK_VALUE(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 && q.stride(2) == 1,
                   "decode_attention: q must be a float32 CPU [B, Hq, D] tensor with contiguous rows");
  for (const auto* t : {&k_cache, &v_cache}) {
    MVLM_CHECK_VALUE(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(), "decode_attention: ",
                     t == &k_cache ? "k_cache" : "v_cache", " must be a contiguous float32 CPU tensor");
  }
  MVLM_CHECK_VALUE(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
                   "decode_attention: equal caches [slots or blocks, length, Hkv, D]");
  const int64_t hq = q.size(1), hkv = k_cache.size(2);
  MVLM_CHECK_VALUE(k_cache.size(3) == q.size(2) && hkv > 0 && hq % hkv == 0, "decode_attention: head dims / GQA groups");
  MVLM_CHECK_VALUE(cache_seqlens.numel() == q.size(0), "decode_attention: cache_seqlens must be [B]");
}

// Where each sequence's keys live: its block table (the slot layout is the paged one with one block, the slot,
// per sequence), its key count (ValueError beyond the capacity) clamped to [0, max_seqlen_k], every table entry
// those keys use validated.
struct KeyTable {
  at::Tensor lens_t, table_t;
  std::vector<int64_t> iota, n;
  const int64_t* table = nullptr;
  int64_t max_blocks = 1, block = 0, hkv = 0;

  // Sequence b's keys j0 .. j0 + count - 1 (count >= 1) as rows of the [blocks * length * Hkv, D] view, filled
  // block by block (a division per key was ~20 % of a call in-cache), padded with the last row for the prefetch
  // look-ahead.
  void fill(int64_t b, int64_t j0, int64_t count, std::vector<int64_t>& rows) const {
    rows.resize(count + kPrefetchKeys);
    for (int64_t j = j0; j < j0 + count;) {
      const int64_t blk = j / block, stop = std::min(j0 + count, (blk + 1) * block);
      const int64_t base = (table[b * max_blocks + blk] - blk) * block;  // row of key j: (base + j) * hkv
      for (; j < stop; ++j) rows[j - j0] = (base + j) * hkv;
    }
    for (int64_t j = count; j < count + kPrefetchKeys; ++j) rows[j] = rows[count - 1];
  }
};

KeyTable key_table(const at::Tensor& k_cache, const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& slot_ids,
                   const std::optional<at::Tensor>& block_table, int64_t batch, int64_t max_seqlen_k) {
  MVLM_CHECK_VALUE(!(slot_ids.has_value() && block_table.has_value()), "decode_attention: slot_ids or block_table");
  KeyTable t;
  t.block = k_cache.size(1), t.hkv = k_cache.size(2);
  if (block_table.has_value()) {
    MVLM_CHECK_VALUE(block_table->dim() == 2 && block_table->size(0) == batch, "decode_attention: block_table [B, blocks]");
    t.table_t = block_table->to(at::kLong).contiguous();
    t.max_blocks = t.table_t.size(1);
  } else if (slot_ids.has_value()) {
    MVLM_CHECK_VALUE(slot_ids->numel() == batch, "decode_attention: slot_ids must be [B]");
    t.table_t = slot_ids->to(at::kLong).contiguous();
  } else {
    t.iota.resize(batch);
    for (int64_t b = 0; b < batch; ++b) t.iota[b] = b;
  }
  t.table = t.table_t.defined() ? t.table_t.data_ptr<int64_t>() : t.iota.data();
  t.lens_t = cache_seqlens.to(at::kLong).contiguous();
  const int64_t* lens = t.lens_t.data_ptr<int64_t>();
  const int64_t capacity = t.max_blocks * t.block;
  const int64_t length = std::max<int64_t>(0, std::min(max_seqlen_k, capacity));
  const int64_t n_blocks = k_cache.size(0);
  t.n.resize(batch);
  for (int64_t b = 0; b < batch; ++b) {  // validate the lengths and the table entries a sequence reads, before any work
    // more keys than the cache holds: a caller's bookkeeping error, not a length to cap silently
    MVLM_CHECK_VALUE(lens[b] <= capacity, "decode_attention: sequence ", b, " has cache_seqlens ", lens[b],
                     " but the cache holds ", capacity, " positions per sequence");
    t.n[b] = std::max<int64_t>(0, std::min(lens[b], length));
    for (int64_t j = 0; j < t.n[b]; j += t.block) {
      const int64_t blk = t.table[b * t.max_blocks + j / t.block];
      MVLM_CHECK_INDEX(blk >= 0 && blk < n_blocks, "decode_attention: sequence ", b, " reads cache block / slot ", blk,
                       " of ", n_blocks);
    }
  }
  return t;
}

}  // namespace

at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& slot_ids,
                                const std::optional<at::Tensor>& block_table, int64_t max_seqlen_k, double scale) {
  check_q_and_caches(q, k_cache, v_cache, cache_seqlens);
  const int64_t batch = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_cache.size(2);
  const KeyTable keys = key_table(k_cache, cache_seqlens, slot_ids, block_table, batch, max_seqlen_k);
  const int64_t group = hq / hkv;
  auto out = at::zeros({batch, hq, d}, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t q_batch_stride = q.stride(0), q_head_stride = q.stride(1);
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  // A task is a sequence with all its kv heads (its cache rows walked in address order), or one kv head of it
  // when there are too few sequences to keep the threads busy. Which one does not change any result.
  const int64_t per_task = batch >= 2 * at::get_num_threads() ? hkv : 1;
  const int64_t chunks_per_seq = hkv / per_task;
  float* op = out.data_ptr<float>();
  const bool wide = use_avx512_path();
  at::parallel_for(0, batch * chunks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> rows;
    std::vector<float> scores, inv(3 * per_task * group);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / chunks_per_seq, h0 = (t % chunks_per_seq) * per_task;
      const int64_t n = keys.n[b];
      if (n <= 0) continue;  // no key: zeros (the convention of the reference)
      keys.fill(b, 0, n, rows);
      scores.resize(per_task * group * n);
      const float* qb = qp + b * q_batch_stride + h0 * group * q_head_stride;
      float* ob = op + (b * hq + h0 * group) * d;
      const float sc = static_cast<float>(scale);
      attend(wide, qb, q_head_stride, kp, vp, rows.data(), n, h0, h0 + per_task, group, d, sc, scores.data(),
             inv.data(), ob);
    }
  });
  return out;
}

// Decode attention (slot or paged layout) where groups of sequences share their first keys (the G samples of one
// prompt in a GRPO rollout each hold a copy of the prompt's keys and values). prefix_rows[b] = r says that the
// first prefix_lens[b] keys of row b equal those of row r (its slot's copy), r a row with prefix_rows[r] = r and
// the same length. Every group of two or more rows reads those keys once: all its rows' query heads attend to
// the root's copy together (one task per group: query head (member i, head e of kv head g) is head i * group + e
// of kv head g: a larger GQA group, run by the head-major kernel on AVX-512, by the 8-wide one otherwise), each
// row then attends to its own keys after the prefix, and the two softmaxes are merged with their maxima and sums.
// The result is the attention over the row's own keys up to fp32 rounding (the split changes the order of the
// sums). Tasks (a group's kv heads, a row's kv heads) are taken from a shared counter, heaviest first, so the
// group tasks do not all land on one thread's static share.
at::Tensor decode_attention_prefix_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& slot_ids,
                                       const std::optional<at::Tensor>& block_table, int64_t max_seqlen_k,
                                       double scale, const at::Tensor& prefix_rows, const at::Tensor& prefix_lens) {
  check_q_and_caches(q, k_cache, v_cache, cache_seqlens);
  const int64_t batch = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_cache.size(2);
  MVLM_CHECK_VALUE(prefix_rows.numel() == batch && prefix_lens.numel() == batch,
                   "decode_attention_prefix: prefix_rows and prefix_lens must be [B]");
  const KeyTable keys = key_table(k_cache, cache_seqlens, slot_ids, block_table, batch, max_seqlen_k);
  const std::vector<int64_t>& n = keys.n;
  const auto proots_t = prefix_rows.to(at::kLong).contiguous();
  const auto plens_t = prefix_lens.to(at::kLong).contiguous();
  const int64_t *proot = proots_t.data_ptr<int64_t>(), *plen = plens_t.data_ptr<int64_t>();
  std::vector<int64_t> pre(batch, 0);
  std::vector<std::vector<int64_t>> members(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t r = proot[b];
    MVLM_CHECK_INDEX(r >= 0 && r < batch, "decode_attention_prefix: prefix_rows[", b, "] = ", r, " is not a row of ",
                     batch);
    MVLM_CHECK_VALUE(proot[r] == r && plen[r] == plen[b], "decode_attention_prefix: row ", b, " shares the prefix of row ",
                     r, ", which must be its own root (prefix_rows[", r, "] = ", r, ") with the same length");
    MVLM_CHECK_VALUE(plen[b] >= 0 && plen[b] <= std::min(n[b], n[r]), "decode_attention_prefix: row ", b,
                     " shares ", plen[b], " keys but it (or its root) has fewer");
    if (plen[b] > 0) members[r].push_back(b);
  }
  std::vector<int64_t> roots, first(1, 0);  // first[i]: the first head of root i's block in the prefix buffers
  std::vector<int64_t> root_of(batch, -1), member_index(batch, -1);
  for (int64_t r = 0; r < batch; ++r) {
    if (members[r].size() < 2) continue;  // a lone row reads its own keys as usual
    for (size_t i = 0; i < members[r].size(); ++i) {
      const int64_t b = members[r][i];
      pre[b] = plen[b], root_of[b] = static_cast<int64_t>(roots.size()), member_index[b] = static_cast<int64_t>(i);
    }
    roots.push_back(r);
    first.push_back(first.back() + static_cast<int64_t>(members[r].size()) * hq);
  }
  const int64_t group = hq / hkv, prefix_heads = first.back();
  std::vector<float> qg(prefix_heads * d), og(prefix_heads * d, 0.0f), pstat(2 * prefix_heads);
  std::vector<float> sstat(2 * batch * hq, 0.0f);  // per row and head: the suffix's max and sum (sum 0: no suffix)
  auto out = at::zeros({batch, hq, d}, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t q_batch_stride = q.stride(0), q_head_stride = q.stride(1);
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t per_task = batch >= 2 * at::get_num_threads() ? hkv : 1;
  const int64_t chunks = hkv / per_task, prefix_tasks = static_cast<int64_t>(roots.size()) * chunks;
  const bool wide = use_avx512_path();
  const float sc = static_cast<float>(scale);
  const int64_t tasks = prefix_tasks + batch * chunks;
  std::atomic<int64_t> next{0};  // the group tasks (the heavy ones) come first
  at::parallel_for(0, std::min<int64_t>(tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    std::vector<int64_t> rows;
    std::vector<float> scores, inv;
    for (int64_t t = next++; t < tasks; t = next++) {
      const int64_t h0 = (t % chunks) * per_task;
      if (t < prefix_tasks) {  // one group's shared keys, all its rows' query heads of kv heads [h0, h0 + per_task)
        const int64_t i = t / chunks, r = roots[i], m = static_cast<int64_t>(members[r].size()), mg = m * group;
        float* qi = qg.data() + first[i] * d;
        for (int64_t g = h0; g < h0 + per_task; ++g) {
          for (int64_t mi = 0; mi < m; ++mi) {
            const float* src = qp + members[r][mi] * q_batch_stride + g * group * q_head_stride;
            for (int64_t e = 0; e < group; ++e) {
              std::memcpy(qi + (g * mg + mi * group + e) * d, src + e * q_head_stride, d * sizeof(float));
            }
          }
        }
        const int64_t heads = per_task * mg, shared = plen[r];
        keys.fill(r, 0, shared, rows);
        scores.resize(std::max(heads * shared, many_buffer_floats(mg, shared, d)));
        inv.resize(3 * heads);
        attend(wide, qi + h0 * mg * d, d, kp, vp, rows.data(), shared, h0, h0 + per_task, mg, d, sc, scores.data(),
               inv.data(), og.data() + (first[i] + h0 * mg) * d, /*many=*/true);
        for (int64_t h = 0; h < heads; ++h) {
          pstat[2 * (first[i] + h0 * mg + h)] = inv[heads + h];
          pstat[2 * (first[i] + h0 * mg + h) + 1] = inv[2 * heads + h];
        }
      } else {  // one row's own keys after its shared prefix (all of them when it shares none)
        const int64_t b = (t - prefix_tasks) / chunks, own = n[b] - pre[b];
        if (own <= 0) continue;  // no key of its own: zeros (no key at all) or the prefix alone
        const int64_t heads = per_task * group;
        keys.fill(b, pre[b], own, rows);
        scores.resize(heads * own);
        inv.resize(3 * heads);
        attend(wide, qp + b * q_batch_stride + h0 * group * q_head_stride, q_head_stride, kp, vp, rows.data(), own, h0,
               h0 + per_task, group, d, sc, scores.data(), inv.data(), op + (b * hq + h0 * group) * d);
        for (int64_t h = 0; h < heads; ++h) {
          sstat[2 * (b * hq + h0 * group + h)] = inv[heads + h];
          sstat[2 * (b * hq + h0 * group + h) + 1] = inv[2 * heads + h];
        }
      }
    }
  });
  // Merge: softmax over prefix + own keys = the two normalised outputs weighted by sum * exp(max - overall max).
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (pre[b] == 0) continue;
      const int64_t i = root_of[b], mg = static_cast<int64_t>(members[roots[i]].size()) * group;
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t ph = first[i] + (h / group) * mg + member_index[b] * group + h % group;
        const float* o1 = og.data() + ph * d;
        float* o2 = op + (b * hq + h) * d;
        const float m1 = pstat[2 * ph], s1 = pstat[2 * ph + 1];
        const float m2 = sstat[2 * (b * hq + h)], s2 = sstat[2 * (b * hq + h) + 1];
        if (s2 == 0.0f) {  // the prefix is all the row's keys
          std::memcpy(o2, o1, d * sizeof(float));
          continue;
        }
        const float mx = std::max(m1, m2), w1 = s1 * std::exp(m1 - mx), w2 = s2 * std::exp(m2 - mx);
        const float r = 1.0f / (w1 + w2);
        for (int64_t c = 0; c < d; ++c) o2[c] = (o1[c] * w1 + o2[c] * w2) * r;
      }
    }
  });
  return out;
}

}  // namespace megatron_vlm
