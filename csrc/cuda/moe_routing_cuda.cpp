// CUDA registrations of the MoE routing ops: argument checks, output allocation on the input's
// device and stream, and the launches of the kernels in moe_routing_kernels.cu.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "check.h"
#include "moe_routing_kernels.h"
#include "ops.h"

namespace megatron_vlm {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_gating_cuda(const at::Tensor& logits_in,
                                                                const std::optional<at::Tensor>& bias_in,
                                                                int64_t top_k, bool use_sigmoid, int64_t n_group,
                                                                int64_t topk_group, bool renormalize,
                                                                double scaling) {
  check_topk_gating_args(logits_in, bias_in, top_k, n_group, topk_group);
  MVLM_CHECK_VALUE(logits_in.size(1) <= cuda::gating_max_experts(), "topk_gating: at most ",
                   cuda::gating_max_experts(), " experts on CUDA");
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const at::Tensor logits = logits_in.contiguous();
  at::Tensor bias;
  if (bias_in.has_value()) bias = bias_in->contiguous();
  const int64_t n = logits.size(0), e = logits.size(1);
  at::Tensor scores = at::empty({n, e}, logits.options());
  at::Tensor weights = at::empty({n, top_k}, logits.options());
  at::Tensor ids = at::empty({n, top_k}, logits.options().dtype(at::kLong));
  C10_CUDA_CHECK(cuda::launch_topk_gating(
      logits.data_ptr<float>(), bias.defined() ? bias.data_ptr<float>() : nullptr, scores.data_ptr<float>(),
      weights.data_ptr<float>(), ids.data_ptr<int64_t>(), n, static_cast<int>(e), static_cast<int>(top_k),
      use_sigmoid, static_cast<int>(n_group), static_cast<int>(topk_group), renormalize,
      static_cast<float>(scaling), c10::cuda::getCurrentCUDAStream()));
  return {scores, weights, ids};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_permute_indices_cuda(const at::Tensor& topk_ids,
                                                                        int64_t num_experts) {
  check_permute_args(topk_ids, num_experts);
  MVLM_CHECK_VALUE(num_experts <= 12288, "moe_permute_indices: at most 12288 experts on CUDA");
  const c10::cuda::CUDAGuard guard(topk_ids.device());
  const at::Tensor flat = topk_ids.to(at::kLong).contiguous().reshape({-1});
  const int64_t pairs = flat.numel();
  MVLM_CHECK_VALUE(pairs < (int64_t{1} << 31), "moe_permute_indices: too many (token, expert) pairs");
  const auto opts = topk_ids.options();
  at::Tensor row_map = at::empty({pairs}, opts.dtype(at::kInt));
  at::Tensor source = at::empty({pairs}, opts.dtype(at::kLong));
  at::Tensor counts = at::empty({num_experts}, opts.dtype(at::kLong));
  at::Tensor workspace =
      at::empty({std::max<int64_t>(cuda::permute_workspace_elems(pairs, static_cast<int>(num_experts)), 1)},
                opts.dtype(at::kInt));
  C10_CUDA_CHECK(cuda::launch_permute_indices(flat.data_ptr<int64_t>(), pairs, static_cast<int>(topk_ids.size(1)),
                                              static_cast<int>(num_experts), workspace.data_ptr<int32_t>(),
                                              row_map.data_ptr<int32_t>(), source.data_ptr<int64_t>(),
                                              counts.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream()));
  return {row_map, source, counts};
}

}  // namespace
}  // namespace megatron_vlm

TORCH_LIBRARY_IMPL(megatron_vlm, CUDA, m) {
  m.impl("topk_gating", &megatron_vlm::topk_gating_cuda);
  m.impl("moe_permute_indices", &megatron_vlm::moe_permute_indices_cuda);
}
