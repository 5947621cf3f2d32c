// The kernel body (attention_body.inc) compiled for AVX2 + FMA, 256-bit vectors.
// bindings.cpp picks a variant at run time (__builtin_cpu_supports, RAGGED_NATIVE_ISA).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "ragged_attention.h"

#pragma GCC target("avx2,fma,f16c")

namespace ragged {
namespace avx2 {
#include "attention_body.inc"
}  // namespace avx2
}  // namespace ragged
