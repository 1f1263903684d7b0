// megatron_vlm._C: declarations shared by the translation units of the compiled extension.
//
// The ops live in the `megatron_vlm` torch library namespace (schemas in registration.cpp):
//   mrope_position_ids   host-side M-RoPE position ids (Qwen2.5-VL / Qwen3-VL get_rope_index rules)
//   first_fit_pack       host-side packing planner (megatron_vlm/data/packing.py first_fit_pack)
//   topk_gating          MoE router: softmax / sigmoid(+bias) scores, grouped top-k, renormalised weights
//   moe_permute_indices  token -> expert permutation by counting (no sort) and per-expert counts
//   rms_norm_fwd / _bwd, swiglu_fwd / _bwd, rotary, decode_attention
//                        fused fp32 CPU kernels of the per-token layer ops (cpu_layer_ops.cpp)
//   varlen_attention_fwd / _bwd
//                        CPU attention over packed short samples, in place (cpu_varlen_attention.cpp)
//   token_logprob_rows / token_logprob_grad_rows
//                        row algebra of the fused LM head + token log-probs (cpu_token_logprobs.cpp)
//   sample_rows          the rollout's untruncated inverse-CDF draw + behaviour log-prob per row (cpu_sampling.cpp)
//   moe_pack_expert_weights / moe_experts
//                        routed MoE experts of an inference step in one call, on MKL-packed weights (cpu_moe_experts.cpp)
// CPU implementations are in host_ops.cpp, moe_routing_cpu.cpp and cpu_layer_ops.cpp, CUDA ones in cuda/.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace megatron_vlm {

std::tuple<at::Tensor, at::Tensor> mrope_position_ids_cpu(
    const at::Tensor& input_ids, const std::optional<at::Tensor>& mm_token_type_ids,
    const std::optional<at::Tensor>& attention_mask, const std::optional<at::Tensor>& cu_seqlens,
    const std::optional<at::Tensor>& image_grid_thw, const std::optional<at::Tensor>& video_grid_thw,
    const std::optional<at::Tensor>& video_intervals, double default_interval, int64_t image_token_id,
    int64_t video_token_id, int64_t spatial_merge_size);

std::tuple<at::Tensor, at::Tensor> first_fit_pack_cpu(const at::Tensor& lengths, const at::Tensor& order,
                                                      int64_t capacity, int64_t max_open);

std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_gating_cpu(const at::Tensor& logits,
                                                               const std::optional<at::Tensor>& bias,
                                                               int64_t top_k, bool use_sigmoid, int64_t n_group,
                                                               int64_t topk_group, bool renormalize,
                                                               double scaling);

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_permute_indices_cpu(const at::Tensor& topk_ids,
                                                                       int64_t num_experts);

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_fwd_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                                const std::optional<at::Tensor>& residual,
                                                                double eps);
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cpu(const at::Tensor& grad, const std::optional<at::Tensor>& grad_summed,
                                                    const at::Tensor& normed_input, const at::Tensor& weight,
                                                    const at::Tensor& rstd);
at::Tensor swiglu_fwd_cpu(const at::Tensor& gate, const at::Tensor& up);
std::tuple<at::Tensor, at::Tensor> swiglu_bwd_cpu(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up);
at::Tensor rotary_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward);
at::Tensor moe_pack_expert_weights_cpu(const at::Tensor& w);
std::tuple<at::Tensor, at::Tensor> moe_experts_cpu(const at::Tensor& x, const at::Tensor& topk_ids,
                                                   const at::Tensor& topk_weights, const at::Tensor& w1,
                                                   const at::Tensor& w2, const std::optional<at::Tensor>& w1_packed,
                                                   const std::optional<at::Tensor>& w2_packed, bool gated,
                                                   int64_t activation);
// Print native frames on SIGSEGV / SIGBUS / SIGILL / SIGFPE, then chain to the previous handler
// (segv_backtrace.cpp). True when every handler was installed.
bool install_segv_backtrace();

// How many threads at::parallel_for used over n items (grain 1): the thread count the CPU ops get. 1 where the
// library was compiled without OpenMP, whatever torch.set_num_threads says (CMakeLists.txt).
int64_t parallel_threads(int64_t n);

at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& slot_ids,
                                const std::optional<at::Tensor>& block_table, int64_t max_seqlen_k, double scale);
at::Tensor decode_attention_prefix_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& slot_ids,
                                       const std::optional<at::Tensor>& block_table, int64_t max_seqlen_k,
                                       double scale, const at::Tensor& prefix_rows, const at::Tensor& prefix_lens);

std::tuple<at::Tensor, at::Tensor> varlen_attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v, const at::Tensor& cu_q,
                                                            const at::Tensor& cu_k, bool causal, double scale);
std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_bwd_cpu(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_q, const at::Tensor& cu_k, bool causal, double scale);

// rollout sampling (cpu_sampling.cpp): per row the token drawn by inverse CDF at u and its log-prob
std::tuple<at::Tensor, at::Tensor> sample_rows_cpu(const at::Tensor& logits, const at::Tensor& uniform,
                                                   const std::optional<at::Tensor>& suppress_ids, double temperature);
std::tuple<at::Tensor, at::Tensor, at::Tensor> token_logprob_rows_cpu(const at::Tensor& z, const at::Tensor& labels,
                                                                      bool with_entropy);
void token_logprob_grad_rows_cpu(const at::Tensor& z, const at::Tensor& labels, const at::Tensor& lse,
                                 const at::Tensor& ent, const at::Tensor& grad_logp,
                                 const std::optional<at::Tensor>& grad_ent, double inv_temperature);

// Argument checks shared by the CPU, CUDA and Meta kernels (they raise ValueError in Python).
void check_topk_gating_args(const at::Tensor& logits, const std::optional<at::Tensor>& bias, int64_t top_k,
                            int64_t n_group, int64_t topk_group);
void check_permute_args(const at::Tensor& topk_ids, int64_t num_experts);

}  // namespace megatron_vlm
