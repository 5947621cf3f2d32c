// The kernel body (attention_body.inc) compiled for AVX-512 (F/BW/VL/DQ + BF16/VNNI), 512-bit vectors.
// Defines RAGGED_AVX512: the body's hot loops in intrinsics (the other variants: portable C++),
// and RAGGED_TILES: bfloat16 prefill chunks as matrix products on vdpbf16ps.
// bindings.cpp picks a variant at run time (__builtin_cpu_supports, RAGGED_NATIVE_ISA).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <immintrin.h>

#include "ragged_attention.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,avx2,fma,f16c,prefer-vector-width=512")

namespace ragged {
namespace avx512 {
#define RAGGED_AVX512 1  // attention_body.inc's intrinsic hot loops
#define RAGGED_TILES 1   // and its extend path on bfloat16 products
#include "attention_body.inc"
}  // namespace avx512
}  // namespace ragged
