// RMSNorm and rotary embedding of a decoder layer on the CPU (elementwise.h), for the hooks in
// sgl_ragged/compat/cpu_ops.py. SGLang's CPU path without sgl-kernel's AMX ops runs their torch
// forms, a dozen small ops each: 16-20 us an RMSNorm and 40-45 us a rotary embedding at 1-8 rows
// on a Zen 5, about a tenth of a decode step of SmolLM2-135M at one request. One pass here.
//
// Numerics follow those torch forms. The rotary embedding is bit for bit: cos and sin are cast
// to the tensors' dtype, and every product, difference and sum is rounded to it, as each torch op
// rounds its output. RMSNorm differs only in the order of the sum of squares (torch's vectorized
// reduction against 16 partial sums here), so its output may differ from torch's by one unit in
// the last place of a 16-bit dtype, rarely (float32: a few units, often); the residual it returns
// is exact. Plain C++ (elementwise_loops.inc) that the compiler vectorizes, built for AVX-512,
// AVX2 and the baseline and run at the attention's ISA variant; contraction off at each, so no
// FMA fuses a product into a sum that torch rounds in between.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "checks.h"
#include "elementwise.h"
#include "pool.h"

namespace ragged {
namespace {

constexpr int64_t SERIAL_ELEMENTS = 1 << 17;  // a call below this many outputs stays serial
constexpr int64_t LANES = 16;                  // partial sums of the sum of squares

// Calls f with a value of the C++ type of dtype (float, bfloat16 or float16).
template <typename F>
void with_type(at::ScalarType dtype, const char* who, const char* name, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default:
      TORCH_CHECK(false, who, ": ", name, " must be float32, bfloat16 or float16, got ", dtype);
  }
}

// The loops, once per instruction set: the compiler vectorizes them 16 floats wide on AVX-512,
// 8 on AVX2, 4 at the baseline (SSE2). Contraction stays off at every width (FMA would fuse a
// product into a sum that torch rounds in between; AVX-512F implies FMA to GCC).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,prefer-vector-width=512")
#pragma GCC optimize("fp-contract=off")
namespace avx512 {
#include "elementwise_loops.inc"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#pragma GCC optimize("fp-contract=off")
namespace avx2 {
#include "elementwise_loops.inc"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
namespace baseline {
#include "elementwise_loops.inc"
}  // namespace baseline
#pragma GCC pop_options

// Which of them runs: the ISA variant of the attention kernels (isa_name(): the CPU's, or a
// lower one that RAGGED_NATIVE_ISA forces).
enum class Width { kBaseline, kAvx2, kAvx512 };

Width width() {
  static const Width w = [] {
    const std::string name = isa_name();
    if (name == "avx512" || name == "amx") return Width::kAvx512;
    return name == "avx2" ? Width::kAvx2 : Width::kBaseline;
  }();
  return w;
}

template <typename T, typename W>
auto norm_rows_at(Width w) {
  switch (w) {
    case Width::kAvx512: return &avx512::norm_rows<T, W>;
    case Width::kAvx2: return &avx2::norm_rows<T, W>;
    default: return &baseline::norm_rows<T, W>;
  }
}

template <typename T>
auto rotate_heads_at(Width w, bool neox) {
  switch (w) {
    case Width::kAvx512: return neox ? &avx512::rotate_heads<T, true> : &avx512::rotate_heads<T, false>;
    case Width::kAvx2: return neox ? &avx2::rotate_heads<T, true> : &avx2::rotate_heads<T, false>;
    default: return neox ? &baseline::rotate_heads<T, true> : &baseline::rotate_heads<T, false>;
  }
}

template <typename T, int64_t DC>
auto hadamard_rows_of(Width w) {
  switch (w) {
    case Width::kAvx512: return &avx512::hadamard_rows<T, DC>;
    case Width::kAvx2: return &avx2::hadamard_rows<T, DC>;
    default: return &baseline::hadamard_rows<T, DC>;
  }
}

// The loop for head_dim D: unrolled at the common head sizes 64 and 128.
template <typename T>
auto hadamard_rows_at(Width w, int64_t D) {
  if (D == 64) return hadamard_rows_of<T, 64>(w);
  if (D == 128) return hadamard_rows_of<T, 128>(w);
  return hadamard_rows_of<T, 0>(w);
}

// Heads of a query or key tensor [T, heads * head] or [T, heads, head], and its row stride.
struct HeadRows {
  int64_t heads, stride;
};

HeadRows head_rows(const at::Tensor& t, const char* name, int64_t tokens, int64_t head) {
  TORCH_CHECK(t.device().is_cpu(), "rotary_embedding: ", name, " must be on the CPU, got ",
              t.device());
  TORCH_CHECK((t.dim() == 2 || t.dim() == 3) && t.size(0) == tokens,
              "rotary_embedding: ", name, " ", t.sizes(), " must be [T, heads * head_size] or "
              "[T, heads, head_size] with T = ", tokens, " positions");
  const int64_t width = t.dim() == 2 ? t.size(1) : t.size(1) * t.size(2);
  TORCH_CHECK(width % head == 0 && (t.dim() == 2 || t.size(2) == head), "rotary_embedding: ",
              name, " ", t.sizes(), " is not made of heads of head_size ", head);
  const bool packed = t.stride(-1) == 1 && (t.dim() == 2 || t.stride(1) == head);
  TORCH_CHECK(packed || t.numel() == 0, "rotary_embedding: ", name, " ", t.sizes(), " strides ",
              t.strides(), ": a token's heads must be contiguous (its rows may be strided)");
  return {width / head, t.stride(0)};
}

}  // namespace

std::vector<at::Tensor> rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                 const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: x and weight must be "
              "on the CPU, got ", x.device(), " and ", weight.device());
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), "rms_norm: x ", x.sizes(), " must be "
              "contiguous with at least one dim");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous(),
              "rms_norm: weight ", weight.sizes(), " must be a contiguous [", H, "] (x's last dim)");
  if (residual) {
    TORCH_CHECK(residual->device().is_cpu() && residual->scalar_type() == x.scalar_type() &&
                    residual->sizes() == x.sizes() && residual->is_contiguous(),
                "rms_norm: residual ", residual->sizes(), " ", residual->scalar_type(),
                " must be contiguous, on the CPU, with x's shape ", x.sizes(), " and dtype ",
                x.scalar_type());
  }
  at::Tensor out = at::empty_like(x);
  at::Tensor res_out = residual ? at::empty_like(x) : at::Tensor();
  const int64_t rows = H ? x.numel() / H : 0;
  const float e = static_cast<float>(eps);
  with_type(x.scalar_type(), "rms_norm", "x", [&](auto xt) {
    using T = decltype(xt);
    with_type(weight.scalar_type(), "rms_norm", "weight", [&](auto wt) {
      using W = decltype(wt);
      const T* xp = x.data_ptr<T>();
      const T* rp = residual ? residual->data_ptr<T>() : nullptr;
      T* rop = residual ? res_out.data_ptr<T>() : nullptr;
      const W* wp = weight.data_ptr<W>();
      T* op = out.data_ptr<T>();
      const auto norm = norm_rows_at<T, W>(width());
      const int64_t grain = std::max<int64_t>(1, SERIAL_ELEMENTS / std::max<int64_t>(H, 1));
      pool::parallel_for(0, rows, grain, [&](int64_t b, int64_t e2) {
        std::vector<float> s(H);
        norm(xp, rp, wp, op, rop, b, e2, H, e, s.data());
      });
    });
  });
  if (residual) return {out, res_out};
  return {out};
}

std::vector<at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& query,
                                         const at::Tensor& key, const at::Tensor& cos_sin_cache,
                                         int64_t head_size, bool neox) {
  TORCH_CHECK(positions.device().is_cpu() && positions.scalar_type() == at::kLong &&
                  positions.dim() == 1,
              "rotary_embedding: positions must be a 1-dim int64 CPU tensor, got ",
              positions.sizes(), " ", positions.scalar_type(), " on ", positions.device());
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "rotary_embedding: query is ",
              query.scalar_type(), " but key is ", key.scalar_type());
  TORCH_CHECK(cos_sin_cache.device().is_cpu() && cos_sin_cache.dim() == 2 &&
                  cos_sin_cache.is_contiguous(),
              "rotary_embedding: cos_sin_cache ", cos_sin_cache.sizes(), " must be a contiguous "
              "[max_position, rotary_dim] CPU tensor");
  const int64_t rot = cos_sin_cache.size(1), max_pos = cos_sin_cache.size(0);
  TORCH_CHECK(head_size > 0 && rot > 0 && rot % 2 == 0 && rot <= head_size, "rotary_embedding: "
              "rotary_dim ", rot, " (cos_sin_cache's width) must be even, positive and at most "
              "head_size ", head_size);
  const int64_t T = positions.size(0);
  const HeadRows q = head_rows(query, "query", T, head_size);
  const HeadRows k = head_rows(key, "key", T, head_size);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary_embedding: position ", pos[t],
                " of token ", t, " is outside the cos_sin_cache's ", max_pos, " rows");
  at::Tensor q_out = at::empty(query.sizes(), query.options());
  at::Tensor k_out = at::empty(key.sizes(), key.options());
  with_type(query.scalar_type(), "rotary_embedding", "query", [&](auto xt) {
    using X = decltype(xt);
    with_type(cos_sin_cache.scalar_type(), "rotary_embedding", "cos_sin_cache", [&](auto ct) {
      using C = decltype(ct);
      const C* cache = cos_sin_cache.data_ptr<C>();
      const X* qp = query.data_ptr<X>();
      const X* kp = key.data_ptr<X>();
      X* qo = q_out.data_ptr<X>();
      X* ko = k_out.data_ptr<X>();
      const auto rotate = rotate_heads_at<X>(width(), neox);
      const int64_t per_token = (q.heads + k.heads) * head_size;
      const int64_t grain = std::max<int64_t>(1, SERIAL_ELEMENTS / std::max<int64_t>(per_token, 1));
      pool::parallel_for(0, T, grain, [&](int64_t b, int64_t e) {
        std::vector<float> cs(rot);  // cos, sin of the token's position, in X's precision
        for (int64_t t = b; t < e; ++t) {
          const C* row = cache + pos[t] * rot;
          for (int64_t j = 0; j < rot; ++j) cs[j] = baseline::rounded<X>(static_cast<float>(row[j]));
          rotate(qp + t * q.stride, qo + t * q.heads * head_size, q.heads, head_size, rot,
                 cs.data(), cs.data() + rot / 2);
          rotate(kp + t * k.stride, ko + t * k.heads * head_size, k.heads, head_size, rot,
                 cs.data(), cs.data() + rot / 2);
        }
      });
    });
  });
  return {q_out, k_out};
}

at::Tensor hadamard_heads(const at::Tensor& x, const at::Tensor& signs, bool inverse) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3, "hadamard_heads: x must be a [T, heads, D] "
              "CPU tensor, got ", x.sizes(), " on ", x.device());
  check_cpu_tensor("hadamard_heads", signs, "signs", at::kFloat, 2);
  const int64_t T = x.size(0), heads = x.size(1), D = x.size(2), kv = signs.size(0);
  TORCH_CHECK(D > 0 && (D & (D - 1)) == 0 && signs.size(1) == D, "hadamard_heads: head_dim ", D,
              " must be a power of two and signs ", signs.sizes(), " [kv_heads, ", D, "]");
  TORCH_CHECK(kv > 0 && heads % kv == 0, "hadamard_heads: x's ", heads, " heads are not a "
              "multiple of the ", kv, " KV heads of signs");
  TORCH_CHECK(x.stride(2) == 1 && (heads == 1 || x.stride(1) == D), "hadamard_heads: x ",
              x.sizes(), " strides ", x.strides(), ": a token's heads must be contiguous (its "
              "rows may be strided)");
  at::Tensor out = at::empty({T, heads, D}, x.options());
  const float root = std::sqrt(static_cast<float>(D));
  const int64_t rows = T * heads;
  with_type(x.scalar_type(), "hadamard_heads", "x", [&](auto xt) {
    using X = decltype(xt);
    const X* xp = x.data_ptr<X>();
    X* op = out.data_ptr<X>();
    const float* sp = signs.data_ptr<float>();
    const auto rotate = hadamard_rows_at<X>(width(), D);
    const int64_t grain = std::max<int64_t>(1, SERIAL_ELEMENTS / D);
    pool::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
      std::vector<float> f(D);
      rotate(xp, op, sp, b, e, heads, heads / kv, D, x.stride(0), inverse, root, f.data());
    });
  });
  return out;
}

}  // namespace ragged
