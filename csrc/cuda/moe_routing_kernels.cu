// CUDA kernels of the MoE routing ops (plain CUDA, no torch headers; launched from moe_routing_cuda.cpp).
//
// topk_gating: one warp per token. The warp computes the row's scores (sigmoid, or softmax with warp
// max / sum reductions) into shared memory, adds the bias for the choice values, optionally keeps the
// topk_group best expert groups (group score = sum of the two best choice values), then takes the
// top_k by k rounds of a warp arg-max (larger value, then lower index, first), gathers the scores as
// weights and renormalises them. Same math as kernels/reference/moe_routing.py.
//
// permute indices (no sort): the N*k (token, slot) pairs are cut into chunks of 256.
//   1. count:   per chunk, a shared-memory histogram of expert ids -> counts[e * C + chunk]
//   2. scan:    one block turns the expert-major counts into exclusive offsets (and per-expert totals)
//   3. scatter: pair i of expert e in chunk c goes to row offsets[e * C + c] + (pairs of e before i
//               in the chunk), so rows of one expert keep the order of i, as a stable sort would.
#include "moe_routing_kernels.h"

#include <cfloat>
#include <climits>

namespace megatron_vlm {
namespace cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kGatingWarps = 4;
constexpr int kChunk = 256;
constexpr int kScanThreads = 1024;

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off /= 2) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, off);
    const int oi = __shfl_xor_sync(0xffffffffu, i, off);
    if (ov > v || (ov == v && oi < i)) {
      v = ov;
      i = oi;
    }
  }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__global__ void topk_gating_kernel(const float* __restrict__ logits, const float* __restrict__ bias,
                                   float* __restrict__ scores, float* __restrict__ weights,
                                   int64_t* __restrict__ ids, int64_t n, int e, int k, bool use_sigmoid, int n_group,
                                   int topk_group, bool renormalize, float scale) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kGatingWarps + warp;
  if (row >= n) return;  // whole warps leave together
  float* s = smem + static_cast<size_t>(warp) * (2 * e + n_group);
  float* choice = s + e;
  float* gscore = choice + e;
  const float* x = logits + row * e;

  if (use_sigmoid) {
    for (int j = lane; j < e; j += kWarp) s[j] = 1.0f / (1.0f + expf(-x[j]));
  } else {
    float m = -FLT_MAX;
    for (int j = lane; j < e; j += kWarp) m = fmaxf(m, x[j]);
    m = warp_max(m);
    float sum = 0.f;
    for (int j = lane; j < e; j += kWarp) {
      const float v = expf(x[j] - m);
      s[j] = v;
      sum += v;
    }
    sum = warp_sum(sum);
    for (int j = lane; j < e; j += kWarp) s[j] = s[j] / sum;
  }
  for (int j = lane; j < e; j += kWarp) choice[j] = bias ? s[j] + bias[j] : s[j];
  __syncwarp();

  if (n_group > 1) {
    const int gsize = e / n_group;
    for (int g = lane; g < n_group; g += kWarp) {
      const float* c = choice + g * gsize;
      float m1 = -INFINITY, m2 = -INFINITY;
      for (int j = 0; j < gsize; ++j) {
        if (c[j] > m1) {
          m2 = m1;
          m1 = c[j];
        } else if (c[j] > m2) {
          m2 = c[j];
        }
      }
      gscore[g] = gsize == 1 ? m1 : m1 + m2;
    }
    __syncwarp();
    // pick topk_group groups; a kept group's score becomes +inf (marker), the others stay finite
    for (int r = 0; r < topk_group; ++r) {
      float v = -INFINITY;
      int i = INT_MAX;
      for (int g = lane; g < n_group; g += kWarp) {
        const float gv = gscore[g];
        if (gv != INFINITY && (gv > v || (gv == v && g < i))) {
          v = gv;
          i = g;
        }
      }
      warp_argmax(v, i);
      if (lane == 0) gscore[i] = INFINITY;
      __syncwarp();
    }
    for (int j = lane; j < e; j += kWarp) {
      if (gscore[j / gsize] != INFINITY) choice[j] = -INFINITY;
    }
    __syncwarp();
  }

  float* w = weights + row * k;
  int64_t* id = ids + row * k;
  for (int r = 0; r < k; ++r) {
    float v = -INFINITY;
    int i = INT_MAX;
    for (int j = lane; j < e; j += kWarp) {
      const float cv = choice[j];
      if (cv > v || (cv == v && j < i)) {
        v = cv;
        i = j;
      }
    }
    warp_argmax(v, i);
    if (lane == 0) {
      id[r] = i;
      w[r] = s[i];
      choice[i] = -INFINITY;  // taken
    }
    __syncwarp();
  }
  if (lane == 0) {  // sequential sum in slot order, as the CPU twin
    float sum = 0.f;
    for (int r = 0; r < k; ++r) sum += w[r];
    const float denom = sum + 1e-20f;
    for (int r = 0; r < k; ++r) w[r] = (renormalize ? w[r] / denom : w[r]) * scale;
  }
  for (int j = lane; j < e; j += kWarp) scores[row * e + j] = s[j];
}

__global__ void count_kernel(const int64_t* __restrict__ experts, int64_t pairs, int num_experts, int chunks,
                             int32_t* __restrict__ counts) {
  extern __shared__ int32_t hist[];
  for (int j = threadIdx.x; j < num_experts; j += blockDim.x) hist[j] = 0;
  __syncthreads();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kChunk + threadIdx.x;
  if (i < pairs) {
    const int64_t ex = experts[i];
    if (ex >= 0 && ex < num_experts) atomicAdd(&hist[ex], 1);
  }
  __syncthreads();
  for (int j = threadIdx.x; j < num_experts; j += blockDim.x) counts[static_cast<int64_t>(j) * chunks + blockIdx.x] = hist[j];
}

__global__ void scan_kernel(int32_t* __restrict__ offsets, int64_t m, int num_experts, int chunks,
                            int64_t* __restrict__ tokens_per_expert) {
  __shared__ int32_t part[kScanThreads];
  const int t = threadIdx.x;
  const int64_t per = (m + kScanThreads - 1) / kScanThreads;
  const int64_t lo = t * per, hi = lo + per < m ? lo + per : m;
  int32_t local = 0;
  for (int64_t j = lo; j < hi; ++j) local += offsets[j];
  part[t] = local;
  __syncthreads();
  for (int off = 1; off < kScanThreads; off *= 2) {  // inclusive Hillis-Steele scan of the partial sums
    const int32_t add = t >= off ? part[t - off] : 0;
    __syncthreads();
    part[t] += add;
    __syncthreads();
  }
  int32_t run = part[t] - local;  // exclusive
  for (int64_t j = lo; j < hi; ++j) {
    const int32_t c = offsets[j];
    offsets[j] = run;
    run += c;
  }
  __syncthreads();
  const int32_t total = part[kScanThreads - 1];
  for (int ex = t; ex < num_experts; ex += kScanThreads) {
    const int32_t begin = offsets[static_cast<int64_t>(ex) * chunks];
    const int32_t end = ex + 1 < num_experts ? offsets[static_cast<int64_t>(ex + 1) * chunks] : total;
    tokens_per_expert[ex] = end - begin;
  }
}

__global__ void scatter_kernel(const int64_t* __restrict__ experts, int64_t pairs, int k, int num_experts, int chunks,
                               const int32_t* __restrict__ offsets, int32_t* __restrict__ row_map,
                               int64_t* __restrict__ source) {
  __shared__ int32_t ex_of[kChunk];
  const int t = threadIdx.x;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kChunk + t;
  int32_t ex = -1;
  if (i < pairs) {
    const int64_t v = experts[i];
    ex = (v >= 0 && v < num_experts) ? static_cast<int32_t>(v) : -1;
  }
  ex_of[t] = ex;
  __syncthreads();
  if (ex < 0) return;
  int32_t rank = 0;
  for (int j = 0; j < t; ++j) rank += ex_of[j] == ex;  // same j across the warp: broadcast reads
  const int32_t row = offsets[static_cast<int64_t>(ex) * chunks + blockIdx.x] + rank;
  row_map[i] = row;
  source[row] = i / k;
}

}  // namespace

int gating_max_experts() { return 1536; }

cudaError_t launch_topk_gating(const float* logits, const float* bias, float* scores, float* weights, int64_t* ids,
                               int64_t n, int e, int k, bool use_sigmoid, int n_group, int topk_group,
                               bool renormalize, float scale, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const size_t smem = sizeof(float) * kGatingWarps * (2 * static_cast<size_t>(e) + n_group);
  if (smem > 48 * 1024) return cudaErrorInvalidValue;
  const unsigned blocks = static_cast<unsigned>((n + kGatingWarps - 1) / kGatingWarps);
  topk_gating_kernel<<<blocks, kGatingWarps * kWarp, smem, stream>>>(
      logits, bias, scores, weights, ids, n, e, k, use_sigmoid, n_group, topk_group, renormalize, scale);
  return cudaGetLastError();
}

int64_t permute_workspace_elems(int64_t pairs, int num_experts) {
  const int64_t chunks = (pairs + kChunk - 1) / kChunk;
  return chunks * num_experts;
}

cudaError_t launch_permute_indices(const int64_t* experts, int64_t pairs, int k, int num_experts, int32_t* workspace,
                                   int32_t* row_map, int64_t* source, int64_t* tokens_per_expert,
                                   cudaStream_t stream) {
  if (num_experts == 0) return cudaSuccess;
  if (pairs == 0) return cudaMemsetAsync(tokens_per_expert, 0, sizeof(int64_t) * num_experts, stream);
  if (static_cast<size_t>(num_experts) * sizeof(int32_t) > 48 * 1024) return cudaErrorInvalidValue;
  const int chunks = static_cast<int>((pairs + kChunk - 1) / kChunk);
  count_kernel<<<chunks, kChunk, sizeof(int32_t) * num_experts, stream>>>(experts, pairs, num_experts, chunks,
                                                                          workspace);
  scan_kernel<<<1, kScanThreads, 0, stream>>>(workspace, static_cast<int64_t>(chunks) * num_experts, num_experts,
                                              chunks, tokens_per_expert);
  scatter_kernel<<<chunks, kChunk, 0, stream>>>(experts, pairs, k, num_experts, chunks, workspace, row_map, source);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace megatron_vlm
