// The kernel body (attention_body.inc) compiled for AVX2 + FMA, 256-bit vectors. Defines
// RAGGED_AVX2: dense keys dotted without the tile transpose (prefill blocks: as key columns),
// the softmax in intrinsics, and integer tiers of bfloat16 storages dotted on their codes with
// vpmaddwd (the body's AVX2 sections); the other loops are the portable C++.
// bindings.cpp picks a variant at run time (__builtin_cpu_supports, RAGGED_NATIVE_ISA).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <immintrin.h>

#include "ragged_attention.h"

#pragma GCC target("avx2,fma,f16c")

namespace ragged {
namespace avx2 {
#define RAGGED_AVX2 1  // attention_body.inc's AVX2 intrinsics
#include "attention_body.inc"
}  // namespace avx2
}  // namespace ragged
