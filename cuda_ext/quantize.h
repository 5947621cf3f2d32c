// Low-tier quantization of sealed pages (quantize.cpp; sgl_ragged/mem_pool/quant.py bit for bit).
#pragma once

#include <torch/extension.h>

#include <vector>

namespace ragged {

// x float32 [N, T, H, D] contiguous -> {codes uint8 [N, T, H, D * bits / 8] (planar packing),
// scale float16, zero float16 (empty for fp8)}: parameters over T ([N, H, D], per_channel: keys)
// or over D ([N, T, H]: values).
std::vector<torch::Tensor> quantize_low(const torch::Tensor& x, int64_t bits, bool is_float,
                                        bool per_channel);

}  // namespace ragged
