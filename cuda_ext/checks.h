// Argument checks shared by the bindings (bindings.cpp, tails.cpp): a message that names the
// entry point, the argument and what it must be.
#pragma once

#include <torch/extension.h>

namespace ragged {

inline void check_cpu_tensor(const char* who, const at::Tensor& t, const char* name,
                             at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), who, ": ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, who, ": ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == dim, who, ": ", name, " must have ", dim, " dims, got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), who, ": ", name, " must be contiguous");
}

}  // namespace ragged
