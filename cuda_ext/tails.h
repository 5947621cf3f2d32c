// The tails' native helpers (tails.cpp: what they compute and why).
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

namespace ragged {

// attn, q_sum, q_sq_sum, q_count of the batch's tail pages for one layer (tail_batch.window_stats).
std::vector<at::Tensor> window_stats(const at::Tensor& q, const at::Tensor& lse,
                                     const at::Tensor& k_pages, const at::Tensor& win_row,
                                     const at::Tensor& win_pos, const at::Tensor& page_start,
                                     const at::Tensor& n_staged, const at::Tensor& prior_stage,
                                     const at::Tensor& attn, const at::Tensor& q_sum,
                                     const at::Tensor& q_sq_sum, const at::Tensor& q_count,
                                     int64_t layer, double scale);

// [k_stage[pages[m], :rows[m]], zeros], the same of v_stage: [M, P, H, D] each.
std::vector<at::Tensor> gather_pages(const at::Tensor& k_stage, const at::Tensor& v_stage,
                                     const at::Tensor& pages, const at::Tensor& rows);

// stats.*[stages[i], layer] = acc.*[i] (StagingStats.store).
void store_stats(at::Tensor& attn, at::Tensor& q_sum, at::Tensor& q_sq_sum,
                 at::Tensor& q_count, int64_t layer, const at::Tensor& stages,
                 const at::Tensor& acc_attn, const at::Tensor& acc_sum, const at::Tensor& acc_sq,
                 const at::Tensor& acc_count);

// dst[slots[i]] = src[rows[i]] (zeros where rows[i] < 0).
void copy_rows(at::Tensor& dst, const at::Tensor& slots, const at::Tensor& src,
               const at::Tensor& rows);

}  // namespace ragged
