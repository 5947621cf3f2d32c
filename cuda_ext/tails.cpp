// The window statistics of a batch's tail pages in one call per layer: the native form of
// tail_batch.window_stats (the torch form stays the reference of these sums).
//
// Page m of the batch's tail pages (tail_batch.TailBatch) saw the window queries of its request,
// rows win_row[m, j] of q at positions win_pos[m, j] (-1: no such query). Per KV head h and
// token i of the page, attn[m, h, i] sums over the window queries that saw the token (its
// position page_start[m] + i <= win_pos[m, j]) the largest softmax probability among h's query
// heads, exp(q . k * scale - lse); q_sum, q_sq_sum pool those queries (all of h's query heads)
// that reached the page (win_pos[m, j] >= page_start[m]), q_count counts them. What the page's
// staging page accumulated before (prior_stage[m] >= 0, row of the staging statistics; its first
// n_staged[m] tokens' attn) is added. Only reads: the caller stores the result through the
// storage's write API. No dequantization, no temporaries beyond the four outputs.
//
// copy_rows(dst, slots, src, rows): dst[slots[i]] = src[rows[i]] (zeros where rows[i] < 0),
// rows of any dtype by memcpy (the staging write of a decode step, RaggedStorage.stage_tokens,
// where torch's gather and index_copy_ cost ~60 us for a few hundred rows of 384 bytes).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "checks.h"
#include "tails.h"

namespace ragged {
namespace {

void check(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim) {
  check_cpu_tensor("window_stats", t, name, dtype, dim);
}

struct Shapes {
  int64_t M, P, H, D, G, w, L;
};

// One (page m, KV head h): attn[P], q_sum[D], q_sq[D] of the outputs.
template <typename T>
void page_head(const Shapes& s, int64_t m, int64_t h, const T* q, const float* lse, const T* k,
               const int64_t* win_row, const int64_t* win_pos, int64_t page_start, float scale,
               float* attn, float* q_sum, float* q_sq, float* scratch) {
  const int64_t P = s.P, D = s.D, G = s.G, Hq = s.H * s.G;
  float *keys = scratch, *qf = scratch + P * D, *best = qf + D;  // [P, D], [D], [P]
  int64_t reach = 0;  // tokens [0, reach) some window query sees
  for (int64_t j = 0; j < s.w; ++j)
    reach = std::max(reach, std::min(P, win_pos[m * s.w + j] - page_start + 1));
  for (int64_t i = 0; i < reach; ++i)  // those keys of head h in float32
    for (int64_t d = 0; d < D; ++d)
      keys[i * D + d] = static_cast<float>(k[((m * P + i) * s.H + h) * D + d]);
  std::fill(attn, attn + P, 0.f);
  std::fill(q_sum, q_sum + D, 0.f);
  std::fill(q_sq, q_sq + D, 0.f);
  for (int64_t j = 0; j < s.w; ++j) {
    const int64_t pos = win_pos[m * s.w + j];
    if (pos < page_start) continue;  // no such query, or it precedes the page
    const int64_t row = win_row[m * s.w + j];
    const int64_t seen = std::min(P, pos - page_start + 1);  // tokens [0, seen) are causal
    std::fill(best, best + seen, 0.f);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t qh = h * G + g;
      const T* qrow = q + (row * Hq + qh) * D;
      for (int64_t d = 0; d < D; ++d) {
        qf[d] = static_cast<float>(qrow[d]);
        q_sum[d] += qf[d];
        q_sq[d] += qf[d] * qf[d];
      }
      const float norm = lse[row * Hq + qh];
      for (int64_t i = 0; i < seen; ++i) {
        const float* key = keys + i * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qf[d] * key[d];
        best[i] = std::max(best[i], std::exp(dot * scale - norm));
      }
    }
    for (int64_t i = 0; i < seen; ++i) attn[i] += best[i];
  }
}

template <typename T>
void run(const Shapes& s, const at::Tensor& q, const at::Tensor& lse, const at::Tensor& k_pages,
         const at::Tensor& win_row, const at::Tensor& win_pos, const at::Tensor& page_start,
         const at::Tensor& n_staged, const at::Tensor& prior_stage,
         const std::vector<at::Tensor>& prior, int64_t layer, double scale,
         const std::vector<at::Tensor>& out) {
  const T* qp = q.data_ptr<T>();
  const T* kp = k_pages.data_ptr<T>();
  const float* lp = lse.data_ptr<float>();
  const int64_t *rows = win_row.data_ptr<int64_t>(), *pos = win_pos.data_ptr<int64_t>();
  const int64_t *start = page_start.data_ptr<int64_t>(), *staged = n_staged.data_ptr<int64_t>();
  const int64_t* stage = prior_stage.data_ptr<int64_t>();
  const float *p_attn = prior[0].data_ptr<float>(), *p_sum = prior[1].data_ptr<float>();
  const float *p_sq = prior[2].data_ptr<float>(), *p_cnt = prior[3].data_ptr<float>();
  float *attn = out[0].data_ptr<float>(), *q_sum = out[1].data_ptr<float>();
  float *q_sq = out[2].data_ptr<float>(), *q_cnt = out[3].data_ptr<float>();
  const int64_t P = s.P, D = s.D, H = s.H;
  const int64_t cost = std::max<int64_t>(1, s.w * s.G * P * D);
  at::parallel_for(0, s.M * H, std::max<int64_t>(1, (1 << 16) / cost), [&](int64_t b, int64_t e) {
    std::vector<float> scratch(P * D + D + P);  // page_head's buffers
    for (int64_t mh = b; mh < e; ++mh) {
      const int64_t m = mh / H, h = mh % H;
      float *a = attn + mh * P, *sm = q_sum + mh * D, *sq = q_sq + mh * D;
      page_head<T>(s, m, h, qp, lp, kp, rows, pos, start[m], static_cast<float>(scale), a, sm,
                   sq, scratch.data());
      if (stage[m] < 0) continue;
      const int64_t at = stage[m] * s.L + layer;  // row of [S + 1, L, ...]
      const float* pa = p_attn + (at * H + h) * P;
      for (int64_t i = 0; i < std::min(P, staged[m]); ++i) a[i] += pa[i];
      const float *ps = p_sum + (at * H + h) * D, *pq = p_sq + (at * H + h) * D;
      for (int64_t d = 0; d < D; ++d) {
        sm[d] += ps[d];
        sq[d] += pq[d];
      }
    }
  });
  for (int64_t m = 0; m < s.M; ++m) {
    int64_t saw = 0;
    for (int64_t j = 0; j < s.w; ++j) saw += pos[m * s.w + j] >= start[m];
    q_cnt[m] = static_cast<float>(saw * s.G);
    if (stage[m] >= 0) q_cnt[m] += p_cnt[stage[m] * s.L + layer];
  }
}

}  // namespace

std::vector<at::Tensor> window_stats(const at::Tensor& q, const at::Tensor& lse,
                                     const at::Tensor& k_pages, const at::Tensor& win_row,
                                     const at::Tensor& win_pos, const at::Tensor& page_start,
                                     const at::Tensor& n_staged, const at::Tensor& prior_stage,
                                     const at::Tensor& attn, const at::Tensor& q_sum,
                                     const at::Tensor& q_sq_sum, const at::Tensor& q_count,
                                     int64_t layer, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "window_stats: q must be float32 or bfloat16, got ", q.scalar_type());
  check(q, "q", q.scalar_type(), 3);
  check(k_pages, "k_pages (same dtype as q)", q.scalar_type(), 4);
  check(lse, "lse", at::kFloat, 2);
  check(win_row, "win_row", at::kLong, 2);
  check(win_pos, "win_pos", at::kLong, 2);
  for (auto [t, name] : {std::pair{&page_start, "page_start"}, {&n_staged, "n_staged"},
                         {&prior_stage, "prior_stage"}})
    check(*t, name, at::kLong, 1);
  check(attn, "stats.attn", at::kFloat, 4);
  check(q_sum, "stats.q_sum", at::kFloat, 4);
  check(q_sq_sum, "stats.q_sq_sum", at::kFloat, 4);
  check(q_count, "stats.q_count", at::kFloat, 2);
  Shapes s{k_pages.size(0), k_pages.size(1), k_pages.size(2), k_pages.size(3), 0,
           win_row.size(1), attn.size(1)};
  TORCH_CHECK(q.size(2) == s.D && q.size(1) % s.H == 0, "window_stats: q ", q.sizes(),
              " does not match k_pages ", k_pages.sizes(), " (head_dim, query heads per KV head)");
  s.G = q.size(1) / s.H;
  TORCH_CHECK(lse.size(0) == q.size(0) && lse.size(1) == q.size(1), "window_stats: lse ",
              lse.sizes(), " must be [N, H_q] of q ", q.sizes());
  for (const at::Tensor* t : {&win_row, &win_pos})
    TORCH_CHECK(t->size(0) == s.M && t->size(1) == s.w, "window_stats: window tables ",
                t->sizes(), " must be [M, w] with M = ", s.M, " tail pages");
  for (const at::Tensor* t : {&page_start, &n_staged, &prior_stage})
    TORCH_CHECK(t->size(0) == s.M, "window_stats: per-page tables must have M = ", s.M,
                " entries, got ", t->sizes());
  TORCH_CHECK(layer >= 0 && layer < s.L, "window_stats: layer ", layer, " outside [0, ", s.L, ")");
  TORCH_CHECK(attn.size(2) == s.H && attn.size(3) == s.P && q_sum.size(3) == s.D,
              "window_stats: staging statistics ", attn.sizes(), " / ", q_sum.sizes(),
              " do not match k_pages ", k_pages.sizes());
  const int64_t rows = q.size(0), stages = attn.size(0);
  const int64_t *r = win_row.data_ptr<int64_t>(), *p = win_pos.data_ptr<int64_t>();
  const int64_t* st = prior_stage.data_ptr<int64_t>();
  for (int64_t m = 0; m < s.M; ++m) {
    TORCH_CHECK(st[m] < stages, "window_stats: prior_stage ", st[m], " of page ", m,
                " is not a staging page (", stages, " rows)");
    for (int64_t j = 0; j < s.w; ++j)
      TORCH_CHECK(p[m * s.w + j] < 0 || (r[m * s.w + j] >= 0 && r[m * s.w + j] < rows),
                  "window_stats: window row ", r[m * s.w + j], " of page ", m,
                  " is not a row of q (", rows, " rows)");
  }
  auto f32 = q.options().dtype(at::kFloat);
  std::vector<at::Tensor> out{at::empty({s.M, s.H, s.P}, f32), at::empty({s.M, s.H, s.D}, f32),
                              at::empty({s.M, s.H, s.D}, f32), at::empty({s.M}, f32)};
  std::vector<at::Tensor> prior{attn, q_sum, q_sq_sum, q_count};
  if (q.scalar_type() == at::kFloat)
    run<float>(s, q, lse, k_pages, win_row, win_pos, page_start, n_staged, prior_stage, prior,
               layer, scale, out);
  else
    run<c10::BFloat16>(s, q, lse, k_pages, win_row, win_pos, page_start, n_staged, prior_stage,
                       prior, layer, scale, out);
  return out;
}

void copy_rows(at::Tensor& dst, const at::Tensor& slots, const at::Tensor& src,
               const at::Tensor& rows) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu(), "copy_rows: dst and src must "
              "be on the CPU");
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "copy_rows: dst and src must be "
              "contiguous");
  TORCH_CHECK(dst.scalar_type() == src.scalar_type(), "copy_rows: src is ", src.scalar_type(),
              " but dst is ", dst.scalar_type(), " (convert it first)");
  check_cpu_tensor("copy_rows", slots, "slots", at::kLong, 1);
  check_cpu_tensor("copy_rows", rows, "rows", at::kLong, 1);
  TORCH_CHECK(dst.dim() >= 1 && src.dim() == dst.dim() && rows.size(0) == slots.size(0) &&
                  src.sizes().slice(1) == dst.sizes().slice(1),
              "copy_rows: src ", src.sizes(), " must be rows of dst ", dst.sizes(),
              ", rows and slots one entry per copied row (", rows.size(0), " vs ",
              slots.size(0), ")");
  const int64_t n = slots.size(0), dst_rows = dst.size(0), src_rows = src.size(0);
  const int64_t bytes = dst.numel() ? dst.nbytes() / dst_rows : 0;
  const int64_t *slot = slots.data_ptr<int64_t>(), *row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < dst_rows, "copy_rows: slot ", slot[i],
                " is outside [0, ", dst_rows, ")");
    TORCH_CHECK(row[i] < src_rows, "copy_rows: row ", row[i], " is outside src's ", src_rows,
                " rows (negative: zeros)");
  }
  auto* d = static_cast<char*>(dst.data_ptr());
  const auto* s = static_cast<const char*>(src.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    if (row[i] < 0)
      std::memset(d + slot[i] * bytes, 0, bytes);
    else
      std::memcpy(d + slot[i] * bytes, s + row[i] * bytes, bytes);
  }
}

}  // namespace ragged
