// Low-tier quantization of sealed pages (quantize.cpp; sgl_ragged/mem_pool/quant.py bit for bit).
#pragma once

#include <c10/util/Half.h>
#include <torch/extension.h>

#include <algorithm>
#include <vector>

namespace ragged {

// x float32 [N, T, H, D] contiguous -> {codes uint8 [N, T, H, D * bits / 8] (planar packing),
// scale float16, zero float16 (empty for fp8)}: parameters over T ([N, H, D], per_channel: keys)
// or over D ([N, T, H]: values).
std::vector<torch::Tensor> quantize_low(const torch::Tensor& x, int64_t bits, bool is_float,
                                        bool per_channel);

// quantize_tokens' working rows, reused across calls.
struct QuantScratch {
  std::vector<float> lo, hi, amax, zf, safe;
  std::vector<uint8_t> row;
  void resize(int64_t T, int64_t D) {
    const size_t n = static_cast<size_t>(std::max(T, D));
    if (zf.size() < n) zf.resize(n), safe.resize(n);
    if (lo.size() < static_cast<size_t>(D)) lo.resize(D), hi.resize(D), amax.resize(D), row.resize(D);
  }
};

// One (page, head)'s T tokens, x[t] its D float32 values, quantized as quantize_low does: token
// t's D * bits / 8 packed codes at codes + t * code_stride; the parameters per channel at
// scale[c], zero[c] (per_channel: keys) or per token at scale[t * param_stride],
// zero[t * param_stride] (values); zero null for fp8.
void quantize_tokens(const float* const* x, int64_t T, int64_t D, int64_t bits, bool is_float,
                     bool per_channel, uint8_t* codes, int64_t code_stride, c10::Half* scale,
                     c10::Half* zero, int64_t param_stride, QuantScratch& scratch);

// Refuses a format quantize_tokens does not code (bits 2, 4 or 8; fp8 8) or a head_dim its
// packing does not divide, naming `who`.
void check_format(const char* who, int64_t bits, bool is_float, int64_t head_dim);

}  // namespace ragged
