// The kernel body (attention_body.inc) compiled for AVX-512 (F/BW/VL/DQ + BF16/VNNI), 512-bit vectors.
// bindings.cpp picks a variant at run time (__builtin_cpu_supports, RAGGED_NATIVE_ISA).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "ragged_attention.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,avx2,fma,f16c,prefer-vector-width=512")

namespace ragged {
namespace avx512 {
#include "attention_body.inc"
}  // namespace avx512
}  // namespace ragged
