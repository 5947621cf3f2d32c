// The kernel body (attention_body.inc) compiled for AVX-512 with the AMX extend path on top:
// defines RAGGED_AVX512 (the same intrinsic hot loops as isa_avx512.cpp), RAGGED_TILES (items
// of bfloat16 storages whose request has more than one query run Q K^T and P V as bfloat16
// matrix products, as on avx512) and RAGGED_AMX (those products on AMX tiles through torch's
// cpublas::brgemm, oneDNN's ukernels, instead of vdpbf16ps).
// bindings.cpp offers this variant ("amx") only where amx::usable() says cpublas packs and
// multiplies bfloat16 here (could_pack: oneDNN ukernels on an AMX CPU).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include "ragged_attention.h"

namespace ragged {
namespace amx {
bool usable() { return at::native::cpublas::could_pack(at::kBFloat16); }
}  // namespace amx
}  // namespace ragged

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,avx2,fma,f16c,prefer-vector-width=512")

namespace ragged {
namespace amx {
#define RAGGED_AVX512 1  // attention_body.inc's intrinsic hot loops
#define RAGGED_AMX 1     // and its brgemm extend path
#define RAGGED_TILES 1   // on AMX tiles (brgemm_bf16 = cpublas::brgemm)
#include "attention_body.inc"
}  // namespace amx
}  // namespace ragged
