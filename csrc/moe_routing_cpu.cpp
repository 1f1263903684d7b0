// MoE routing ops of megatron_vlm._C on the CPU (twins of the CUDA kernels in cuda/):
//
// * topk_gating: scores = softmax(logits) or sigmoid(logits); the choice adds the score-correction
//   bias (auxiliary-loss-free balancing); grouped selection keeps the topk_group best of n_group
//   contiguous expert groups (group score = sum of its two best choice values, as Nemotron-H /
//   DeepSeek-V3) before the top-k; weights = chosen scores, renormalised (+1e-20) and scaled.
//   Same math as kernels/reference/moe_routing.py. Scores come from ATen's softmax / sigmoid so that
//   they are bitwise the reference's, and the selection then sees the same values.
// * moe_permute_indices: the index part of kernels.moe_permute by counting instead of sorting:
//   per-expert counts, exclusive prefix sum, stable scatter (pairs of one expert keep their order).
#include "check.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace megatron_vlm {

void check_topk_gating_args(const at::Tensor& logits, const std::optional<at::Tensor>& bias, int64_t top_k,
                            int64_t n_group, int64_t topk_group) {
  MVLM_CHECK_VALUE(logits.dim() == 2, "topk_gating: logits must be [N, E], got ", logits.sizes());
  MVLM_CHECK_VALUE(logits.scalar_type() == at::kFloat, "topk_gating: logits must be float32, got ",
                   logits.scalar_type());
  const int64_t e = logits.size(1);
  MVLM_CHECK_VALUE(top_k > 0 && top_k <= e, "topk_gating: top_k ", top_k, " must be in 1..", e);
  MVLM_CHECK_VALUE(n_group > 0 && e % n_group == 0 && topk_group > 0 && topk_group <= n_group,
                   "topk_gating: n_group ", n_group, " must divide ", e, " and topk_group ", topk_group,
                   " be in 1..n_group");
  MVLM_CHECK_VALUE(top_k <= topk_group * (e / n_group), "topk_gating: top_k exceeds the experts of the kept groups");
  if (bias.has_value()) {
    MVLM_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == e, "topk_gating: bias must be [E]");
    MVLM_CHECK_VALUE(bias->scalar_type() == at::kFloat, "topk_gating: bias must be float32");
    MVLM_CHECK_VALUE(bias->device() == logits.device(), "topk_gating: bias on another device than logits");
  }
}

void check_permute_args(const at::Tensor& topk_ids, int64_t num_experts) {
  MVLM_CHECK_VALUE(topk_ids.dim() == 2, "moe_permute_indices: topk_ids must be [N, k]");
  MVLM_CHECK_VALUE(!at::isFloatingType(topk_ids.scalar_type()) && topk_ids.scalar_type() != at::kBool,
                   "moe_permute_indices: topk_ids must be an integer tensor");
  MVLM_CHECK_VALUE(num_experts >= 0, "moe_permute_indices: num_experts must be >= 0");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_gating_cpu(const at::Tensor& logits_in,
                                                               const std::optional<at::Tensor>& bias_in,
                                                               int64_t top_k, bool use_sigmoid, int64_t n_group,
                                                               int64_t topk_group, bool renormalize,
                                                               double scaling) {
  check_topk_gating_args(logits_in, bias_in, top_k, n_group, topk_group);
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor scores = use_sigmoid ? at::sigmoid(logits) : at::softmax(logits, -1);
  at::Tensor bias;
  if (bias_in.has_value()) bias = bias_in->contiguous();
  const int64_t n = logits.size(0), e = logits.size(1), gsize = e / n_group;
  at::Tensor weights = at::empty({n, top_k}, logits.options());
  at::Tensor ids = at::empty({n, top_k}, logits.options().dtype(at::kLong));
  const float* s_all = scores.data_ptr<float>();
  const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* w_all = weights.data_ptr<float>();
  int64_t* id_all = ids.data_ptr<int64_t>();
  const float scale = static_cast<float>(scaling);
  const float ninf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    std::vector<float> choice(e), gscore(n_group);
    std::vector<int64_t> idx(std::max(e, n_group));
    // larger value first, lower index first on ties
    auto by_value = [](const std::vector<float>& v) {
      return [&v](int64_t a, int64_t c) { return v[a] > v[c] || (v[a] == v[c] && a < c); };
    };
    for (int64_t r = begin; r < end; ++r) {
      const float* s = s_all + r * e;
      for (int64_t x = 0; x < e; ++x) choice[x] = b ? s[x] + b[x] : s[x];
      if (n_group > 1) {
        for (int64_t g = 0; g < n_group; ++g) {
          const float* c = choice.data() + g * gsize;
          if (gsize == 1) {
            gscore[g] = c[0];
            continue;
          }
          float m1 = ninf, m2 = ninf;  // two largest
          for (int64_t x = 0; x < gsize; ++x) {
            if (c[x] > m1) {
              m2 = m1;
              m1 = c[x];
            } else if (c[x] > m2) {
              m2 = c[x];
            }
          }
          gscore[g] = m1 + m2;
        }
        std::iota(idx.begin(), idx.begin() + n_group, 0);
        std::partial_sort(idx.begin(), idx.begin() + topk_group, idx.begin() + n_group, by_value(gscore));
        std::vector<char> keep(n_group, 0);
        for (int64_t g = 0; g < topk_group; ++g) keep[idx[g]] = 1;
        for (int64_t x = 0; x < e; ++x) {
          if (!keep[x / gsize]) choice[x] = ninf;
        }
      }
      std::iota(idx.begin(), idx.begin() + e, 0);
      std::partial_sort(idx.begin(), idx.begin() + top_k, idx.begin() + e, by_value(choice));
      float* w = w_all + r * top_k;
      int64_t* id = id_all + r * top_k;
      float sum = 0.f;
      for (int64_t j = 0; j < top_k; ++j) {
        id[j] = idx[j];
        w[j] = s[idx[j]];
        sum += w[j];
      }
      const float denom = sum + 1e-20f;
      for (int64_t j = 0; j < top_k; ++j) w[j] = (renormalize ? w[j] / denom : w[j]) * scale;
    }
  });
  return {scores, weights, ids};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_permute_indices_cpu(const at::Tensor& topk_ids,
                                                                       int64_t num_experts) {
  check_permute_args(topk_ids, num_experts);
  const at::Tensor flat = topk_ids.to(at::kLong).contiguous().reshape({-1});
  const int64_t pairs = flat.numel(), k = topk_ids.size(1);
  const int64_t* ex = flat.data_ptr<int64_t>();
  at::Tensor counts = at::zeros({num_experts}, topk_ids.options().dtype(at::kLong));
  int64_t* cnt = counts.data_ptr<int64_t>();
  for (int64_t i = 0; i < pairs; ++i) {
    MVLM_CHECK_VALUE(ex[i] >= 0 && ex[i] < num_experts, "moe_permute_indices: expert id ", ex[i],
                     " outside 0..", num_experts - 1);
    ++cnt[ex[i]];
  }
  std::vector<int64_t> next(static_cast<size_t>(num_experts));
  int64_t run = 0;
  for (int64_t x = 0; x < num_experts; ++x) {
    next[x] = run;
    run += cnt[x];
  }
  at::Tensor row_map = at::empty({pairs}, topk_ids.options().dtype(at::kInt));
  at::Tensor source = at::empty({pairs}, topk_ids.options().dtype(at::kLong));
  int32_t* rm = row_map.data_ptr<int32_t>();
  int64_t* src = source.data_ptr<int64_t>();
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t row = next[ex[i]]++;
    rm[i] = static_cast<int32_t>(row);
    src[row] = k ? i / k : 0;
  }
  return {row_map, source, counts};
}

}  // namespace megatron_vlm
