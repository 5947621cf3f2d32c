// A dense layer's bfloat16 product on the CPU (linear.cpp).
#pragma once

#include <torch/extension.h>

#include <optional>

namespace ragged {

// bf16(x @ weight^T + bias): x [M, K], weight [N, K], bias [N] (all bfloat16, contiguous; x may
// have more leading dims), products and sums in float32, rounded to bfloat16 once.
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias);

// Which form linear_bf16 runs here: "avx512_bf16" (vdpbf16ps dots below linear_dot_rows() rows,
// the AVX2 forms from there), "avx2" (AVX2 + FMA) or "scalar".
std::string linear_isa();

// Below how many rows linear_bf16 runs its AVX512-BF16 dots here (0: it does not).
int64_t linear_dot_rows();

// The dots' calls of fewer than this many products (M x N x K) run on the calling thread, larger
// ones split over torch's intra-op pool (default 2^22; process-wide). The products are the same
// bits either way: each output is one thread's sum.
void set_linear_dot_serial_macs(int64_t macs);
int64_t linear_dot_serial_macs();

}  // namespace ragged
