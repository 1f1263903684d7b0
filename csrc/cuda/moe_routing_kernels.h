// Launchers of the CUDA routing kernels (moe_routing_kernels.cu); plain CUDA types so that the .cu
// file compiles without torch headers (fast nvcc builds, and checkable with nvcc alone).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace megatron_vlm {
namespace cuda {

int gating_max_experts();

cudaError_t launch_topk_gating(const float* logits, const float* bias, float* scores, float* weights, int64_t* ids,
                               int64_t n, int e, int k, bool use_sigmoid, int n_group, int topk_group,
                               bool renormalize, float scale, cudaStream_t stream);

int64_t permute_workspace_elems(int64_t pairs, int num_experts);

cudaError_t launch_permute_indices(const int64_t* experts, int64_t pairs, int k, int num_experts, int32_t* workspace,
                                   int32_t* row_map, int64_t* source, int64_t* tokens_per_expert,
                                   cudaStream_t stream);

}  // namespace cuda
}  // namespace megatron_vlm
