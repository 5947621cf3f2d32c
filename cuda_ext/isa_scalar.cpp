// The kernel body (attention_body.inc) compiled for the baseline ISA (portable fallback).
// bindings.cpp picks a variant at run time (__builtin_cpu_supports, RAGGED_NATIVE_ISA).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "ragged_attention.h"

// no target pragma: the baseline x86-64 ISA (SSE2) the compiler defaults to

namespace ragged {
namespace scalar {
#include "attention_body.inc"
}  // namespace scalar
}  // namespace ragged
