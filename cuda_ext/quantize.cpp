// Low-tier quantization of sealed pages in one call (sgl_ragged/mem_pool/quant.py `_quantize`,
// bit for bit): the torch version issues about 15 small ops per tensor, and sealing runs it
// for keys and values of every group of every layer (a prefill chunk: ~200 calls).
//
// x float32 [N, T, H, D] contiguous; the parameters are shared along T (keys: per channel over
// a page's tokens, scale and zero [N, H, D]) or along D (values: per token, [N, T, H]):
//   integer b bits:  zero = half(min), scale = half((max - zero) / (2^b - 1)),
//                    code = clamp(round_half_even((x - zero) / scale'), 0, 2^b - 1)
//   fp8 (e4m3fn):    scale = half(max |x| / 448), code = e4m3fn(clamp(x / scale', -448, 448))
// with scale' = scale where positive, else 1 (all arithmetic in float32, the parameters as
// float16 values, as torch computes them). Codes are packed planar: byte i of a token's
// D * b / 8 holds channels i, i + D * b / 8, ... at bit offsets 0, b, ... (quant.pack).
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "quantize.h"

namespace ragged {
namespace {

constexpr float kFp8Max = 448.0f;

struct Params {
  c10::Half scale, zero;
  float safe, zf;  // the divisor (scale, or 1 where scale is not positive) and float(zero)
};

Params integer_params(float lo, float hi, int64_t levels) {
  Params p;
  p.zero = c10::Half(lo);
  p.zf = static_cast<float>(p.zero);
  p.scale = c10::Half((hi - p.zf) / static_cast<float>(levels));
  const float s = static_cast<float>(p.scale);
  p.safe = s > 0.f ? s : 1.f;
  return p;
}

Params float_params(float amax) {
  Params p;
  p.zero = c10::Half(0.f);
  p.zf = 0.f;
  p.scale = c10::Half(amax / kFp8Max);
  const float s = static_cast<float>(p.scale);
  p.safe = s > 0.f ? s : 1.f;
  return p;
}

// Codes of one token's D values: channel c by params (zf[c], safe[c]) (keys: a page's
// per-channel parameters; values: the token's own, broadcast). Cloned per ISA so that the
// rounding and the division vectorize (nearbyint is a libm call below SSE4.1).
__attribute__((target_clones("avx512f", "avx2", "default")))
void integer_codes(const float* __restrict x, const float* __restrict zf,
                   const float* __restrict safe, uint8_t* __restrict out, int64_t D, float levels,
                   bool broadcast) {
  if (broadcast) {
    const float z = zf[0], s = safe[0];
    for (int64_t c = 0; c < D; ++c)  // the default rounding: half to even
      out[c] = static_cast<uint8_t>(std::min(std::max(std::nearbyint((x[c] - z) / s), 0.f), levels));
    return;
  }
  for (int64_t c = 0; c < D; ++c)
    out[c] = static_cast<uint8_t>(std::min(std::max(std::nearbyint((x[c] - zf[c]) / safe[c]), 0.f), levels));
}

void float_codes(const float* x, const float* safe, uint8_t* out, int64_t D, bool broadcast) {
  for (int64_t c = 0; c < D; ++c) {
    const float y = std::min(std::max(x[c] / (broadcast ? safe[0] : safe[c]), -kFp8Max), kFp8Max);
    out[c] = c10::Float8_e4m3fn(y).x;
  }
}

// Running min, max and max |x| of one token's D values into lo, hi, amax (per channel).
__attribute__((target_clones("avx512f", "avx2", "default")))
void channel_extrema(const float* __restrict x, float* __restrict lo, float* __restrict hi,
                     float* __restrict amax, int64_t D) {
  for (int64_t c = 0; c < D; ++c) {
    lo[c] = std::min(lo[c], x[c]);
    hi[c] = std::max(hi[c], x[c]);
    amax[c] = std::max(amax[c], std::fabs(x[c]));
  }
}

// One token's D codes (unpacked, channel order) -> its D * bits / 8 packed bytes.
void pack_token(const uint8_t* codes, uint8_t* out, int64_t D, int64_t bits) {
  const int64_t per = 8 / bits, nbytes = D / per;
  for (int64_t i = 0; i < nbytes; ++i) {
    uint8_t byte = 0;
    for (int64_t j = 0; j < per; ++j) byte |= static_cast<uint8_t>(codes[j * nbytes + i] << (j * bits));
    out[i] = byte;
  }
}

}  // namespace

void quantize_tokens(const float* const* x, int64_t T, int64_t D, int64_t bits, bool is_float,
                     bool per_channel, uint8_t* codes, int64_t code_stride, c10::Half* scale,
                     c10::Half* zero, int64_t param_stride, QuantScratch& scratch) {
  const int64_t levels = (int64_t(1) << bits) - 1;
  const float inf = std::numeric_limits<float>::infinity();
  scratch.resize(T, D);
  float* zf = scratch.zf.data();
  float* safe = scratch.safe.data();
  auto keep = [&](int64_t g, const Params& p, int64_t slot) {
    zf[g] = p.zf;
    safe[g] = p.safe;
    scale[slot] = p.scale;
    if (zero) zero[slot] = p.zero;
  };
  // 1. Parameters: per channel over the tokens (keys), or per token over the channels.
  if (per_channel) {
    float* lo = scratch.lo.data();
    float* hi = scratch.hi.data();
    float* amax = scratch.amax.data();
    std::fill(lo, lo + D, inf);
    std::fill(hi, hi + D, -inf);
    std::fill(amax, amax + D, 0.f);
    for (int64_t t = 0; t < T; ++t) channel_extrema(x[t], lo, hi, amax, D);
    for (int64_t c = 0; c < D; ++c)
      keep(c, is_float ? float_params(amax[c]) : integer_params(lo[c], hi[c], levels), c);
  } else {
    for (int64_t t = 0; t < T; ++t) {
      const float* xt = x[t];
      float l = inf, u = -inf, a = 0.f;
      for (int64_t c = 0; c < D; ++c) {
        l = std::min(l, xt[c]);
        u = std::max(u, xt[c]);
        a = std::max(a, std::fabs(xt[c]));
      }
      keep(t, is_float ? float_params(a) : integer_params(l, u, levels), t * param_stride);
    }
  }
  // 2. Each token's codes, packed.
  uint8_t* row = scratch.row.data();
  for (int64_t t = 0; t < T; ++t) {
    const float* z = per_channel ? zf : zf + t;
    const float* s = per_channel ? safe : safe + t;
    if (is_float)
      float_codes(x[t], s, row, D, !per_channel);
    else
      integer_codes(x[t], z, s, row, D, static_cast<float>(levels), !per_channel);
    uint8_t* out = codes + t * code_stride;
    if (bits == 8)
      std::copy(row, row + D, out);
    else
      pack_token(row, out, D, bits);
  }
}

void check_format(const char* who, int64_t bits, bool is_float, int64_t head_dim) {
  TORCH_CHECK(is_float ? bits == 8 : (bits == 2 || bits == 4 || bits == 8), who,
              ": bits must be 2, 4 or 8 (fp8: 8), got ", bits);
  TORCH_CHECK(head_dim % (8 / bits) == 0, who, ": head_dim ", head_dim, " is not a multiple of ",
              8 / bits);
}

std::vector<torch::Tensor> quantize_low(const torch::Tensor& x, int64_t bits, bool is_float,
                                        bool per_channel) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.is_contiguous() &&
                  x.dim() == 4,
              "quantize_low: x must be a contiguous float32 CPU tensor [N, T, H, D], got ",
              x.scalar_type(), " ", x.sizes());
  const int64_t N = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3);
  check_format("quantize_low", bits, is_float, D);
  const int64_t nbytes = D * bits / 8;
  auto codes = torch::empty({N, T, H, nbytes}, x.options().dtype(torch::kUInt8));
  auto half = x.options().dtype(torch::kFloat16);
  auto scale = per_channel ? torch::empty({N, H, D}, half) : torch::empty({N, T, H}, half);
  auto zero = is_float ? torch::empty({0}, half) : torch::empty_like(scale);
  const float* xs = x.data_ptr<float>();
  uint8_t* cs = codes.data_ptr<uint8_t>();
  auto* ss = reinterpret_cast<c10::Half*>(scale.data_ptr<at::Half>());
  auto* zs = is_float ? nullptr : reinterpret_cast<c10::Half*>(zero.data_ptr<at::Half>());
  QuantScratch scratch;
  std::vector<const float*> rows(T);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t t = 0; t < T; ++t) rows[t] = xs + ((n * T + t) * H + h) * D;
      // keys: [N, H, D] at (n, h); values: [N, T, H] at (n, t, h), t strided by H
      const int64_t at = per_channel ? (n * H + h) * D : n * T * H + h;
      quantize_tokens(rows.data(), T, D, bits, is_float, per_channel,
                      cs + (n * T * H + h) * nbytes, H * nbytes, ss + at, zs ? zs + at : nullptr,
                      H, scratch);
    }
  return {codes, scale, zero};
}

}  // namespace ragged
