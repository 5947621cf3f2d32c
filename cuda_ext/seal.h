// Sealing's row writer for one layer in one call (seal.cpp; mem_pool/storage.py `_write_rows`
// under TierRows, bit for bit).
#pragma once

#include <torch/extension.h>

#include <vector>

namespace ragged {

// Writes the rows of N full pages of one layer as the torch row writer does: per group and
// member head, the `hi` best tokens of each page by score (sinks first, ties to the earlier)
// into its high tier and the next `lo` into its low tier, each in position order; dense high
// tiers take the tokens at the rows' dtype, quantized tiers their codes and parameters
// (quantize_tokens: keys per channel over the tier's tokens, values per token).
//
// k_tok, v_tok [N, P, H, D] (float32, bfloat16 or float16); scores [N, H, P] float32; sinks
// [N, P] bool; pages [N] int64 logical pages (-1: nothing written). heads: the groups' KV
// heads, concatenated; groups: 7 integers a group (its head count, hi, lo, high tier bits and
// is_float (0 0: dense), low tier bits and is_float (0 0: none)); tensors: 14 a group (rows_k,
// rows_v, the high tier's k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, the low tier's
// six), empty where the group has no such tier or its format no zero points (as attend takes
// them).
void seal_rows(const at::Tensor& k_tok, const at::Tensor& v_tok, const at::Tensor& scores,
               const at::Tensor& sinks, const at::Tensor& pages, const std::vector<int64_t>& heads,
               const std::vector<int64_t>& groups,
               const std::vector<at::Tensor>& tensors);

}  // namespace ragged
