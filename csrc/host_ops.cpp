// Host-side data ops of megatron_vlm._C, C++ twins of Python loops that run per batch on the CPU:
//
// * mrope_position_ids: megatron_vlm/models/common/mrope_index.py get_mrope_position_ids (runs of
//   text / image / video tokens -> 3-D positions; the original Qwen2.5-VL get_rope_index rule, and
//   Qwen3-VL's rule, which the caller expresses as one [1, h, w] grid per frame).
// * first_fit_pack: megatron_vlm/data/packing.py first_fit_pack (samples visited in the given
//   order go to the first open pack with room; at most max_open packs stay open).
//
// Both must equal the Python implementations exactly. On any invalid input they raise, and the
// Python dispatch (megatron_vlm/_ext.py) then runs the Python implementation, which raises the
// documented error; so the messages here only need to be useful, not identical.
#include "check.h"
#include "ops.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace megatron_vlm {
namespace {

// Consumes image / video grids and video intervals in order over the whole batch.
struct GridCursor {
  const int64_t* image = nullptr;
  int64_t num_images = 0, next_image = 0;
  const int64_t* video = nullptr;
  int64_t num_videos = 0, next_video = 0;
  const double* intervals = nullptr;  // nullptr: every video uses default_interval
  int64_t num_intervals = 0, next_interval = 0;
  double default_interval = 1.0;
};

// Positions of one unpadded sequence of token types `ty` (n tokens) into out[0..2][col[q]];
// returns max(position) + 1 - n (the rope delta; 0 for an empty sequence).
int64_t sequence_positions(const int64_t* ty, const int64_t* col, int64_t n, GridCursor& cur, int64_t merge,
                           int64_t* out_t, int64_t* out_h, int64_t* out_w) {
  int64_t pos = 0, max_pos = -1;
  int64_t i = 0;
  while (i < n) {
    const int64_t kind = ty[i];
    int64_t j = i + 1;
    while (j < n && ty[j] == kind) ++j;
    const int64_t len = j - i;
    if (kind == 0) {
      for (int64_t q = 0; q < len; ++q) {
        const int64_t c = col[i + q];
        out_t[c] = out_h[c] = out_w[c] = pos + q;
      }
      max_pos = std::max(max_pos, pos + len - 1);
      pos += len;
    } else if (kind == 1 || kind == 2) {
      const int64_t* grid;
      double interval = 1.0;
      if (kind == 1) {
        MVLM_CHECK_VALUE(cur.next_image < cur.num_images, "more image placeholder runs than image grids");
        grid = cur.image + 3 * cur.next_image++;
      } else {
        MVLM_CHECK_VALUE(cur.next_video < cur.num_videos, "more video placeholder runs than video grids");
        grid = cur.video + 3 * cur.next_video++;
        interval = cur.default_interval;
        if (cur.intervals != nullptr) {
          MVLM_CHECK_VALUE(cur.next_interval < cur.num_intervals, "more video runs than second_per_grid_ts");
          interval = cur.intervals[cur.next_interval++];
        }
      }
      MVLM_CHECK_VALUE(grid[0] >= 0 && grid[1] >= 0 && grid[2] >= 0, "negative grid");
      const int64_t t = grid[0], h = grid[1] / merge, w = grid[2] / merge;
      MVLM_CHECK_VALUE(t * h * w == len, "a vision run's length does not match its grid");
      int64_t q = i;
      for (int64_t it = 0; it < t; ++it) {
        // a float64 product then truncation, as vLLM (mrope_index.py's docstring)
        const int64_t tp = static_cast<int64_t>(static_cast<double>(it) * interval) + pos;
        max_pos = std::max(max_pos, tp);
        for (int64_t ih = 0; ih < h; ++ih) {
          for (int64_t iw = 0; iw < w; ++iw, ++q) {
            const int64_t c = col[q];
            out_t[c] = tp;
            out_h[c] = pos + ih;
            out_w[c] = pos + iw;
          }
        }
      }
      if (h > 0) max_pos = std::max(max_pos, pos + h - 1);
      if (w > 0) max_pos = std::max(max_pos, pos + w - 1);
      pos = max_pos + 1;  // the original Qwen2.5-VL rule: after the run's largest position
    } else {
      MVLM_CHECK_VALUE(false, "mm_token_type_ids has value ", kind, "; expected 0, 1 or 2");
    }
    i = j;
  }
  return (n ? max_pos + 1 : 0) - n;
}

at::Tensor grids_or_empty(const std::optional<at::Tensor>& g, const char* name) {
  if (!g.has_value()) return at::empty({0, 3}, at::kLong);
  MVLM_CHECK_VALUE(g->dim() == 2 && g->size(1) == 3, name, " must be [n, 3]");
  return g->to(at::kCPU, at::kLong).contiguous();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> mrope_position_ids_cpu(
    const at::Tensor& input_ids, const std::optional<at::Tensor>& mm_token_type_ids,
    const std::optional<at::Tensor>& attention_mask, const std::optional<at::Tensor>& cu_seqlens,
    const std::optional<at::Tensor>& image_grid_thw, const std::optional<at::Tensor>& video_grid_thw,
    const std::optional<at::Tensor>& video_intervals, double default_interval, int64_t image_token_id,
    int64_t video_token_id, int64_t spatial_merge_size) {
  MVLM_CHECK_VALUE(input_ids.dim() == 2, "input_ids must be [B, T]");
  MVLM_CHECK_VALUE(spatial_merge_size > 0, "spatial_merge_size must be > 0");
  const int64_t batch = input_ids.size(0), seq = input_ids.size(1);
  at::Tensor types;
  if (mm_token_type_ids.has_value()) {
    MVLM_CHECK_VALUE(mm_token_type_ids->sizes() == input_ids.sizes(), "mm_token_type_ids shape != input_ids shape");
    types = mm_token_type_ids->to(at::kCPU, at::kLong).contiguous();
  } else {
    const at::Tensor ids = input_ids.to(at::kCPU, at::kLong).contiguous();
    types = at::empty({batch, seq}, at::kLong);
    const int64_t* p = ids.data_ptr<int64_t>();
    int64_t* o = types.data_ptr<int64_t>();
    for (int64_t q = 0; q < batch * seq; ++q) {  // video after image, as the Python assignment order
      o[q] = p[q] == video_token_id ? 2 : (p[q] == image_token_id ? 1 : 0);
    }
  }
  const at::Tensor img = grids_or_empty(image_grid_thw, "image_grid_thw");
  const at::Tensor vid = grids_or_empty(video_grid_thw, "video_grid_thw");
  at::Tensor iv;
  GridCursor cur;
  cur.image = img.data_ptr<int64_t>();
  cur.num_images = img.size(0);
  cur.video = vid.data_ptr<int64_t>();
  cur.num_videos = vid.size(0);
  cur.default_interval = default_interval;
  if (video_intervals.has_value()) {
    iv = video_intervals->to(at::kCPU, at::kDouble).contiguous().reshape({-1});
    cur.intervals = iv.data_ptr<double>();
    cur.num_intervals = iv.numel();
  }

  // filled here, single-threaded: at::zeros would hand ~1 MB to the intra-op thread pool, whose
  // wake-up costs more than the fill on a busy machine
  at::Tensor position_ids = at::empty({3, batch, seq}, at::kLong);
  int64_t* out = position_ids.data_ptr<int64_t>();
  std::fill(out, out + 3 * batch * seq, int64_t{0});
  const int64_t* ty_all = types.data_ptr<int64_t>();
  std::vector<int64_t> deltas;
  std::vector<int64_t> col(seq), ty(seq);

  if (cu_seqlens.has_value()) {
    MVLM_CHECK_VALUE(batch == 1, "packed input (cu_seqlens) needs batch size 1");
    MVLM_CHECK_VALUE(!attention_mask.has_value(), "pass either cu_seqlens or attention_mask, not both");
    const at::Tensor cu = cu_seqlens->to(at::kCPU, at::kLong).contiguous().reshape({-1});
    const int64_t* b = cu.data_ptr<int64_t>();
    const int64_t nb = cu.numel();
    MVLM_CHECK_VALUE(nb >= 1 && b[0] == 0 && b[nb - 1] == seq, "cu_seqlens must rise from 0 to T");
    for (int64_t s = 0; s + 1 < nb; ++s) MVLM_CHECK_VALUE(b[s + 1] >= b[s], "cu_seqlens must not decrease");
    for (int64_t q = 0; q < seq; ++q) col[q] = q;
    for (int64_t s = 0; s + 1 < nb; ++s) {
      const int64_t lo = b[s], hi = b[s + 1];
      deltas.push_back(sequence_positions(ty_all + lo, col.data() + lo, hi - lo, cur, spatial_merge_size, out,
                                          out + seq, out + 2 * seq));
    }
  } else {
    at::Tensor keep;
    if (attention_mask.has_value()) {
      MVLM_CHECK_VALUE(attention_mask->sizes() == input_ids.sizes(), "attention_mask shape != input_ids shape");
      keep = attention_mask->to(at::kCPU).ne(0).contiguous();
    }
    for (int64_t bi = 0; bi < batch; ++bi) {
      const int64_t* row = ty_all + bi * seq;
      int64_t n = 0;
      if (keep.defined()) {
        const bool* k = keep.data_ptr<bool>() + bi * seq;
        for (int64_t q = 0; q < seq; ++q) {
          if (k[q]) {
            col[n] = q;
            ty[n++] = row[q];
          }
        }
      } else {
        for (int64_t q = 0; q < seq; ++q) {
          col[q] = q;
          ty[q] = row[q];
        }
        n = seq;
      }
      int64_t* base = out + bi * seq;
      deltas.push_back(sequence_positions(ty.data(), col.data(), n, cur, spatial_merge_size, base,
                                          base + batch * seq, base + 2 * batch * seq));
    }
  }
  at::Tensor d = at::empty({static_cast<int64_t>(deltas.size()), 1}, at::kLong);
  std::copy(deltas.begin(), deltas.end(), d.data_ptr<int64_t>());
  return {position_ids, d};
}

std::tuple<at::Tensor, at::Tensor> first_fit_pack_cpu(const at::Tensor& lengths_in, const at::Tensor& order_in,
                                                      int64_t capacity, int64_t max_open) {
  MVLM_CHECK_VALUE(capacity > 0, "capacity must be > 0");
  const at::Tensor lengths = lengths_in.to(at::kCPU, at::kLong).contiguous().reshape({-1});
  const at::Tensor order = order_in.to(at::kCPU, at::kLong).contiguous().reshape({-1});
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* ord = order.data_ptr<int64_t>();
  const int64_t num_lengths = lengths.numel(), n = order.numel();

  struct Open {
    int64_t pack, room;
  };
  std::vector<Open> open;  // open packs, oldest first
  open.reserve(static_cast<size_t>(std::max<int64_t>(max_open, 0)) + 1);
  std::vector<int64_t> pack_of(n), size_of;
  for (int64_t q = 0; q < n; ++q) {
    const int64_t i = ord[q];
    MVLM_CHECK_VALUE(i >= 0 && i < num_lengths, "order index out of range");
    const int64_t need = len[i];
    MVLM_CHECK_VALUE(need <= capacity, "sample longer than the pack capacity");
    MVLM_CHECK_VALUE(need > 0, "sample of length <= 0");
    size_t p = 0;
    for (; p < open.size(); ++p) {
      if (open[p].room >= need) break;
    }
    if (p < open.size()) {
      pack_of[q] = open[p].pack;
      ++size_of[open[p].pack];
      open[p].room -= need;
      if (open[p].room == 0) open.erase(open.begin() + static_cast<std::ptrdiff_t>(p));
    } else {
      const int64_t id = static_cast<int64_t>(size_of.size());
      pack_of[q] = id;
      size_of.push_back(1);
      if (capacity - need > 0) {
        open.push_back({id, capacity - need});
        if (static_cast<int64_t>(open.size()) > max_open) open.erase(open.begin());
      }
    }
  }
  const int64_t num_packs = static_cast<int64_t>(size_of.size());
  at::Tensor offsets = at::empty({num_packs + 1}, at::kLong);
  at::Tensor samples = at::empty({n}, at::kLong);
  int64_t* off = offsets.data_ptr<int64_t>();
  off[0] = 0;
  for (int64_t p = 0; p < num_packs; ++p) off[p + 1] = off[p] + size_of[p];
  std::vector<int64_t> fill(off, off + num_packs);
  int64_t* out = samples.data_ptr<int64_t>();
  for (int64_t q = 0; q < n; ++q) out[fill[pack_of[q]]++] = ord[q];
  return {samples, offsets};
}

}  // namespace megatron_vlm
