// What the bindings (bindings.cpp, tails.cpp, linear.cpp, seal.cpp) share: argument checks with a
// message that names the entry point, the argument and what it must be, and the ISA variant chosen.
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

// Pages and slots a page of a quantized tier (check_tier).
struct TierExtent {
  int64_t pages, slots;
};

// The six tensors of a quantized tier, t[0..5] = k_codes, k_scale, k_zero, v_codes, v_scale,
// v_zero (mem_pool/quant.py's shapes), checked for `bits`-bit codes (zero points only where
// !is_float) of `heads` heads of head_dim D, messages naming `who` and the tier (`at`, e.g.
// "group 1 low tier "); returns the extent of its codes. The attention reads tiers checked
// here (bindings.cpp), sealing writes them (seal.cpp).
inline TierExtent check_tier(const char* who, const at::Tensor* t, int64_t bits, bool is_float,
                             int64_t heads, int64_t D, const std::string& at) {
  const int64_t cb = D * bits / 8;
  check_cpu_tensor(who, t[0], (at + "k_codes").c_str(), at::kByte, 4);
  check_cpu_tensor(who, t[3], (at + "v_codes").c_str(), at::kByte, 4);
  check_cpu_tensor(who, t[1], (at + "k_scale").c_str(), at::kHalf, 3);
  check_cpu_tensor(who, t[4], (at + "v_scale").c_str(), at::kHalf, 3);
  const int64_t pages = t[0].size(0), slots = t[0].size(1);
  TORCH_CHECK(t[0].size(2) == heads && t[0].size(3) == cb && t[3].sizes() == t[0].sizes(),
              who, ": ", at, "code shapes ", t[0].sizes(), " / ", t[3].sizes(),
              " are not [pages, slots, ", heads, ", ", cb, "] (", bits, "-bit codes)");
  TORCH_CHECK(t[1].size(0) == pages && t[1].size(1) == heads && t[1].size(2) == D &&
                  t[4].size(0) == pages && t[4].size(1) == slots && t[4].size(2) == heads,
              who, ": ", at, "k_scale ", t[1].sizes(), " / v_scale ", t[4].sizes(),
              " are not [", pages, ", ", heads, ", ", D, "] / [", pages, ", ", slots, ", ",
              heads, "]");
  if (!is_float) {
    check_cpu_tensor(who, t[2], (at + "k_zero").c_str(), at::kHalf, 3);
    check_cpu_tensor(who, t[5], (at + "v_zero").c_str(), at::kHalf, 3);
    TORCH_CHECK(t[2].sizes() == t[1].sizes() && t[5].sizes() == t[4].sizes(), who, ": ", at,
                "zero points ", t[2].sizes(), " / ", t[5].sizes(), " do not match the scales");
  }
  return {pages, slots};
}

}  // namespace ragged
