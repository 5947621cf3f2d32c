// What the bindings (bindings.cpp, tails.cpp, linear.cpp) share: argument checks with a message
// that names the entry point, the argument and what it must be, and the ISA variant chosen.
#pragma once

#include <torch/extension.h>

#include <string>

namespace ragged {

// The ISA variant the attention runs (bindings.cpp: the best this CPU supports, or
// RAGGED_NATIVE_ISA's); window_stats takes its AVX-512 form on avx512 and amx, linear_bf16 its
// dots there and its AVX2 forms on every variant but scalar, rms_norm and rotary_embedding their
// loops at the variant's width.
std::string isa_name();

inline void check_cpu_tensor(const char* who, const at::Tensor& t, const char* name,
                             at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), who, ": ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, who, ": ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == dim, who, ": ", name, " must have ", dim, " dims, got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), who, ": ", name, " must be contiguous");
}

}  // namespace ragged
