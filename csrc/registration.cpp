// megatron_vlm._C: op schemas (TORCH_LIBRARY(megatron_vlm)), CPU and Meta registrations, and the
// Python module entry point.
//
// The library is a plain shared object that Python imports as `megatron_vlm._C` (PyInit__C below
// creates an empty module); importing it runs the static registrations, after which the ops are
// torch.ops.megatron_vlm.*. It links libtorch but not libtorch_python or pybind11, which keeps the
// build small. The Meta kernels give output shapes for FakeTensor / torch.compile; the packing op
// has a data-dependent output size and gets its fake kernel in Python (megatron_vlm/_ext.py).
#include <Python.h>
#include <torch/library.h>

#include "check.h"
#include "ops.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

namespace megatron_vlm {
namespace {

std::tuple<at::Tensor, at::Tensor> mrope_position_ids_meta(
    const at::Tensor& input_ids, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, double, int64_t, int64_t, int64_t) {
  MVLM_CHECK_VALUE(input_ids.dim() == 2, "input_ids must be [B, T]");
  const auto opts = input_ids.options().dtype(at::kLong);
  const c10::SymInt samples = cu_seqlens.has_value() ? cu_seqlens->sym_size(0) - 1 : input_ids.sym_size(0);
  return {at::empty_symint({3, input_ids.sym_size(0), input_ids.sym_size(1)}, opts),
          at::empty_symint({samples, 1}, opts)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_gating_meta(const at::Tensor& logits,
                                                                const std::optional<at::Tensor>& bias,
                                                                int64_t top_k, bool, int64_t n_group,
                                                                int64_t topk_group, bool, double) {
  check_topk_gating_args(logits, bias, top_k, n_group, topk_group);
  return {at::empty_like(logits), at::empty_symint({logits.sym_size(0), top_k}, logits.options()),
          at::empty_symint({logits.sym_size(0), top_k}, logits.options().dtype(at::kLong))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_permute_indices_meta(const at::Tensor& topk_ids,
                                                                        int64_t num_experts) {
  check_permute_args(topk_ids, num_experts);
  const c10::SymInt pairs = topk_ids.sym_numel();
  const auto opts = topk_ids.options();
  return {at::empty_symint({pairs}, opts.dtype(at::kInt)), at::empty_symint({pairs}, opts.dtype(at::kLong)),
          at::empty({num_experts}, opts.dtype(at::kLong))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_fwd_meta(const at::Tensor& x, const at::Tensor&,
                                                                 const std::optional<at::Tensor>& residual, double) {
  // symbolic sizes (torch.compile with dynamic shapes): no int64 size / numel call here
  const c10::SymInt h = x.sym_size(-1);
  return {at::empty_like(x), residual.has_value() ? at::empty_like(x) : at::empty({0}, x.options()),
          at::empty_symint({h == 0 ? c10::SymInt(0) : x.sym_numel() / h}, x.options())};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_meta(const at::Tensor&, const std::optional<at::Tensor>&,
                                                     const at::Tensor& normed_input, const at::Tensor& weight,
                                                     const at::Tensor&) {
  return {at::empty_like(normed_input), at::empty_like(weight)};
}

at::Tensor swiglu_fwd_meta(const at::Tensor& gate, const at::Tensor&) { return at::empty_like(gate); }

std::tuple<at::Tensor, at::Tensor> swiglu_bwd_meta(const at::Tensor&, const at::Tensor& gate, const at::Tensor& up) {
  return {at::empty_like(gate), at::empty_like(up)};
}

at::Tensor rotary_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&, bool) { return at::empty_like(x); }

at::Tensor decode_attention_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, int64_t, double) {
  return at::empty_symint(q.sym_sizes(), q.options());
}

at::Tensor decode_attention_prefix_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, int64_t,
                                        double, const at::Tensor&, const at::Tensor&) {
  return at::empty_symint(q.sym_sizes(), q.options());
}

std::tuple<at::Tensor, at::Tensor> varlen_attention_fwd_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&,
                                                             const at::Tensor&, const at::Tensor&, bool, double) {
  return {at::empty_like(q), at::empty_symint({q.sym_size(0), q.sym_size(1)}, q.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_bwd_meta(
    const at::Tensor&, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, bool, double) {
  return {at::empty_like(q), at::empty_like(k), at::empty_like(v)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> token_logprob_rows_meta(const at::Tensor& z, const at::Tensor&, bool) {
  const auto opts = z.options();
  return {at::empty_symint({z.sym_size(0)}, opts), at::empty_symint({z.sym_size(0)}, opts),
          at::empty_symint({z.sym_size(0)}, opts)};
}

std::tuple<at::Tensor, at::Tensor> moe_experts_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor& w1, const at::Tensor&,
                                                    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                                    bool, int64_t) {
  return {at::empty_like(x), at::empty_symint({w1.sym_size(0)}, x.options().dtype(at::kLong))};
}

void token_logprob_grad_rows_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const std::optional<at::Tensor>&, double) {}

}  // namespace
}  // namespace megatron_vlm

TORCH_LIBRARY(megatron_vlm, m) {
  m.def("parallel_threads(int n) -> int", &megatron_vlm::parallel_threads);
  m.def("install_segv_backtrace() -> bool", &megatron_vlm::install_segv_backtrace);
  m.def(
      "mrope_position_ids(Tensor input_ids, Tensor? mm_token_type_ids, Tensor? attention_mask, "
      "Tensor? cu_seqlens, Tensor? image_grid_thw, Tensor? video_grid_thw, Tensor? video_intervals, "
      "float default_interval, int image_token_id, int video_token_id, int spatial_merge_size) -> (Tensor, Tensor)");
  m.def("first_fit_pack(Tensor lengths, Tensor order, int capacity, int max_open) -> (Tensor, Tensor)");
  m.def(
      "topk_gating(Tensor logits, Tensor? bias, int top_k, bool use_sigmoid, int n_group, int topk_group, "
      "bool renormalize, float scaling) -> (Tensor, Tensor, Tensor)");
  m.def("moe_permute_indices(Tensor topk_ids, int num_experts) -> (Tensor, Tensor, Tensor)");
  m.def("rms_norm_fwd(Tensor x, Tensor weight, Tensor? residual, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("rms_norm_bwd(Tensor grad, Tensor? grad_summed, Tensor normed_input, Tensor weight, Tensor rstd) -> (Tensor, Tensor)");
  m.def("swiglu_fwd(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_bwd(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, bool backward) -> Tensor");
  m.def("token_logprob_rows(Tensor z, Tensor labels, bool with_entropy) -> (Tensor, Tensor, Tensor)");
  m.def("sample_rows(Tensor logits, Tensor uniform, Tensor? suppress_ids, float temperature) -> (Tensor, Tensor)");
  m.def(
      "token_logprob_grad_rows(Tensor(a!) z, Tensor labels, Tensor lse, Tensor ent, Tensor grad_logp, Tensor? grad_ent, "
      "float inv_temperature) -> ()");
  m.def("varlen_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_k, bool causal, float scale) -> "
        "(Tensor, Tensor)");
  m.def(
      "varlen_attention_bwd(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_q, "
      "Tensor cu_k, bool causal, float scale) -> (Tensor, Tensor, Tensor)");
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? slot_ids, Tensor? block_table, "
      "int max_seqlen_k, float scale) -> Tensor");
  m.def(
      "decode_attention_prefix(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? slot_ids, "
      "Tensor? block_table, int max_seqlen_k, float scale, Tensor prefix_rows, Tensor prefix_lens) -> Tensor");
  m.def("moe_pack_expert_weights(Tensor w) -> Tensor");
  m.def(
      "moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w1, Tensor w2, Tensor? w1_packed, "
      "Tensor? w2_packed, bool gated, int activation) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megatron_vlm, CPU, m) {
  m.impl("mrope_position_ids", &megatron_vlm::mrope_position_ids_cpu);
  m.impl("first_fit_pack", &megatron_vlm::first_fit_pack_cpu);
  m.impl("topk_gating", &megatron_vlm::topk_gating_cpu);
  m.impl("moe_permute_indices", &megatron_vlm::moe_permute_indices_cpu);
  m.impl("rms_norm_fwd", &megatron_vlm::rms_norm_fwd_cpu);
  m.impl("rms_norm_bwd", &megatron_vlm::rms_norm_bwd_cpu);
  m.impl("swiglu_fwd", &megatron_vlm::swiglu_fwd_cpu);
  m.impl("swiglu_bwd", &megatron_vlm::swiglu_bwd_cpu);
  m.impl("rotary", &megatron_vlm::rotary_cpu);
  m.impl("token_logprob_rows", &megatron_vlm::token_logprob_rows_cpu);
  m.impl("sample_rows", &megatron_vlm::sample_rows_cpu);
  m.impl("token_logprob_grad_rows", &megatron_vlm::token_logprob_grad_rows_cpu);
  m.impl("varlen_attention_fwd", &megatron_vlm::varlen_attention_fwd_cpu);
  m.impl("varlen_attention_bwd", &megatron_vlm::varlen_attention_bwd_cpu);
  m.impl("decode_attention", &megatron_vlm::decode_attention_cpu);
  m.impl("decode_attention_prefix", &megatron_vlm::decode_attention_prefix_cpu);
  m.impl("moe_pack_expert_weights", &megatron_vlm::moe_pack_expert_weights_cpu);
  m.impl("moe_experts", &megatron_vlm::moe_experts_cpu);
}

TORCH_LIBRARY_IMPL(megatron_vlm, Meta, m) {
  m.impl("mrope_position_ids", &megatron_vlm::mrope_position_ids_meta);
  m.impl("topk_gating", &megatron_vlm::topk_gating_meta);
  m.impl("moe_permute_indices", &megatron_vlm::moe_permute_indices_meta);
  m.impl("rms_norm_fwd", &megatron_vlm::rms_norm_fwd_meta);
  m.impl("rms_norm_bwd", &megatron_vlm::rms_norm_bwd_meta);
  m.impl("swiglu_fwd", &megatron_vlm::swiglu_fwd_meta);
  m.impl("swiglu_bwd", &megatron_vlm::swiglu_bwd_meta);
  m.impl("rotary", &megatron_vlm::rotary_meta);
  m.impl("token_logprob_rows", &megatron_vlm::token_logprob_rows_meta);
  m.impl("token_logprob_grad_rows", &megatron_vlm::token_logprob_grad_rows_meta);
  m.impl("varlen_attention_fwd", &megatron_vlm::varlen_attention_fwd_meta);
  m.impl("varlen_attention_bwd", &megatron_vlm::varlen_attention_bwd_meta);
  m.impl("decode_attention", &megatron_vlm::decode_attention_meta);
  m.impl("decode_attention_prefix", &megatron_vlm::decode_attention_prefix_meta);
  m.impl("moe_experts", &megatron_vlm::moe_experts_meta);
}

// `import megatron_vlm._C` (after `import torch`): an empty module; the registrations above ran
// when the shared object was loaded.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "megatron_vlm._C",
                                      "Compiled ops of megatron-vlm (torch.ops.megatron_vlm.*)", -1, nullptr};
  PyObject* m = PyModule_Create(&module);
  if (m != nullptr) {
#ifdef MEGATRON_VLM_WITH_CUDA
    PyModule_AddIntConstant(m, "with_cuda", 1);
#else
    PyModule_AddIntConstant(m, "with_cuda", 0);
#endif
  }
  return m;
}
