// A dense layer's bfloat16 product for CPUs without bfloat16 dot products (AVX2 without
// AVX512-BF16 or AMX), where torch converts inside its bfloat16 product at a fraction of its
// float32 speed, and for decode batches on AVX512-BF16, where torch's bfloat16 product streams
// the weights at half to two thirds of the speed of the dots below (sgl_ragged/compat/
// cpu_gemm.py, the hook that calls it; docs/results.md, "Decode rows on vdpbf16ps").
//
// y[m, n] = bf16(sum_k x[m, k] w[n, k] + bias[n]): products and sums in float32, rounded to
// bfloat16 once, as torch's bfloat16 product accumulates (in another order). The weight stays
// bfloat16 in memory and is read once per call: a bfloat16 value is the high half of a float32,
// so making it float32 is a shift (or a mask, for the odd channel of a 32-bit lane). x is
// converted to float32 once per call (M x K floats, small beside the weight).
//
// Work, by the number of activation rows M (decode batches' requests, prefill chunks' tokens):
// - 1 or 2 rows: streams. The weight rows one after another, each read whole before the next,
//   so a thread's rows are one run of memory, read in order and prefetched a kilobyte ahead
//   (STREAM_AHEAD channels); x split as the quads' (below), 32 channels a step: two loads of 16
//   weights made float32 by the quads' shift and mask, 4 accumulators per row of x, summed across
//   lanes 4 weight rows at a time. Split over the kernels' pool (pool.h; a call of fewer than
//   SERIAL_MACS products stays on the calling thread). Before session 65 these rows read blocks
//   of 4 weight rows side by side (4 interleaved runs of 1-3 KB each), at about 16-19 GB/s
//   against the 21-24 GB/s of one run in order: a model step ran x1.2-1.3 faster at 1 row,
//   x1.1-1.2 at 2 (docs/results.md, "Decode's weights read in memory order"). K's last K % 16
//   channels run the scalar form.
// - QUAD_ROWS (3) to PANEL_ROWS - 1 (20) rows: split quads. One 256-bit load of 16 bfloat16
//   weights is both halves of 8 float32 lanes, channels 2i (low) and 2i + 1 (high): `v << 16` and
//   `v & 0xFFFF0000` make them float32 in two ALU ops, with x laid out to match once per call
//   (each 16 channels as their 8 even, then their 8 odd ones). 4 rows of x at a time against a
//   pair of weight rows: per 16 channels 2 weight loads, 4 ALU ops, 8 loads of x and 16 FMAs
//   into 8 accumulators. The pair is read from memory by the first 4 rows (prefetching its
//   memory QUAD_AHEAD channels on, in order: x1.0-1.2 over prefetching the next pair's two rows
//   side by side, session 65) and from L1 by the others. Against what these rows took before
//   session 64 (3 to 7: the blocks on a float32 buffer of their weights; 8 to 20: the panels), a
//   30-layer model step ran x1.93-1.97 at 3-4 rows, x1.57 at 8, x1.24 at 12 and x1.09-1.13 at
//   20; at 23-24 the panels were even or ahead (docs/results.md, "Decode's dense layers in split
//   quads"). K's last K % 16 channels and an odd last weight row run the scalar form.
// - From PANEL_ROWS rows the product is compute-bound, and the weight goes through panels: PC = 16
//   weight rows widened and transposed into a float32 panel [K][16] (64 KB at K = 1024, in L2),
//   then PR = 6 activation rows at a time against it as outer products: per channel, two panel
//   vectors and six broadcast activations feed 12 FMAs into 12 accumulators (the register file's
//   16 less the operands), and the six rows' 16 outputs are rounded to bfloat16 in vectors.
//   Panels split over the kernels' pool; each panel is packed once per call (a 1/M share of its
//   products) and sweeps all M rows of x, from L2 or L3.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <immintrin.h>

#include "checks.h"
#include "pool.h"
#include "linear.h"

namespace ragged {
namespace {

constexpr int64_t SERIAL_MACS = 1 << 18;  // below this, one thread (about 20 us of work)
constexpr int64_t PR = 6;                 // panel form: activation rows per micro-block
constexpr int64_t PC = 16;                // panel form: weight rows per panel (two vectors)
constexpr int64_t QUAD_ROWS = 3;          // from this many rows, the split quads
// How far ahead of what it reads a decode product prefetches its weights, in bfloat16 channels of
// the weight's memory: 1-2 rows (streams, 1 KB) and the quads (4 KB), the best of the distances
// tried on a Zen 3 (docs/results.md, "Decode's weights read in memory order").
constexpr int64_t STREAM_AHEAD = 512;
constexpr int64_t QUAD_AHEAD = 2048;
constexpr int64_t PANEL_ROWS = 21;        // from this many rows, the panel form
// Below this many rows on AVX512-BF16, vdpbf16ps dots (compat/cpu_gemm sends larger calls to
// torch's bfloat16 product). On a Zen 4, 2 threads, with their weights prefetched in memory order
// (DOT_AHEAD), the dots beat torch's product x1.3-1.4 at 32-48 rows, x1.26 at 64, x1.13-1.14 at
// 96-128 (lm_head x1.01-1.09 at 64-128), were even at 192 and x0.95-0.99 at 256 (docs/results.md,
// "AVX512-BF16 dots' weights prefetched in memory order"). Before that prefetch they stopped at 48:
// on a Zen 5 with spinning workers they had beaten torch x1.3-1.7 at 24-48 rows and x1.1 at 56-63
// (lm_head x0.9 there; "Decode's small products on both cores").
constexpr int64_t DOT_ROWS = 128;
// The dots stay on one thread below dot_serial_macs products (set_linear_dot_serial_macs; the
// caller, compat/cpu_gemm.py, sets 2^18 on the kernels' own pool, whose caller never waits for a
// worker to wake, and under RAGGED_NATIVE_POOL=openmp picks it from how OpenMP's idle workers
// wait). Where those sleep at once, waking them for each of a step's 120 products cost more than
// the second core gave (a Zen 5, SmolLM2's model step at 1 row: 9.4 ms split from 2^18 products,
// 7.7 from 2^22, this default); where they spin first, the split pays from 2^18 (docs/results.md,
// "Decode's small products on both cores" and "The native kernels' own pool").
std::atomic<int64_t> dot_serial_macs{int64_t(1) << 22};

inline float bf16_float(uint16_t v) {
  const uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Rows [0, M) of x against weight row n, channels [k0, K) added to acc (the portable form with
// k0 = 0; the AVX2 form's last K % 8 channels on top of its vector sums).
void dot_scalar(const float* xf, int64_t M, int64_t K, const uint16_t* w, int64_t n, int64_t k0,
                float* acc /* [M] */) {
  const uint16_t* wr = w + n * K;
  for (int64_t m = 0; m < M; ++m) {
    float s = 0.0f;
    for (int64_t k = k0; k < K; ++k) s += xf[m * K + k] * bf16_float(wr[k]);
    acc[m] += s;
  }
}

void finish(float* acc, int64_t M, int64_t N, int64_t n, const uint16_t* bias, at::BFloat16* y) {
  const float b = bias ? bf16_float(bias[n]) : 0.0f;
  for (int64_t m = 0; m < M; ++m) y[m * N + n] = at::BFloat16(acc[m] + b);
}

void rows_scalar(const float* xf, int64_t M, int64_t K, int64_t N, const uint16_t* w,
                 const uint16_t* bias, int64_t n0, int64_t n1, at::BFloat16* y) {
  std::vector<float> acc(M);
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    dot_scalar(xf, M, K, w, n, 0, acc.data());
    finish(acc.data(), M, N, n, bias, y);
  }
}

// The position of channel k's activation in x split as wide::split_rows lays it out: in each 16
// channels of the first K16, the 8 even ones, then the 8 odd ones; the rest in order.
inline int64_t split_channel(int64_t k) {
  const int64_t i = k & 15;
  return (k & ~int64_t(15)) + (i & 1 ? 8 + i / 2 : i / 2);
}

// Weight rows [n0, n1) against x split as wide::split_rows lays it out (xs): the quads' last
// weight row where N is odd (only the AVX2 path splits x).
void rows_split_scalar(const float* xs, int64_t M, int64_t K, int64_t N, const uint16_t* w,
                       const uint16_t* bias, int64_t n0, int64_t n1, at::BFloat16* y) {
  const int64_t K16 = K & ~int64_t(15);
  std::vector<float> acc(M);
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      float sum = 0.0f;
      for (int64_t k = 0; k < K16; ++k) sum += xs[m * K + split_channel(k)] * bf16_float(wr[k]);
      acc[m] = sum;
    }
    if (K16 < K) dot_scalar(xs, M, K, w, n, K16, acc.data());
    finish(acc.data(), M, N, n, bias, y);
  }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace wide {

inline __m256 widen(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 16 bfloat16 values (channels k..k + 15) as float32: the even channels and the odd ones (the
// split quads, in the header).
inline void split16(const void* p, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}

// x [M, K] bfloat16 -> xs [M, K] float32, each 16 channels k.. as x[k], x[k + 2], .., x[k + 14],
// then x[k + 1], .., x[k + 15]; channels from K16 on in their order (split_channel).
void split_rows(const uint16_t* x, int64_t M, int64_t K, float* xs) {
  const int64_t K16 = K & ~int64_t(15);
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xr = x + m * K;
    float* out = xs + m * K;
    for (int64_t k = 0; k < K16; k += 16) {
      __m256 e, o;
      split16(xr + k, e, o);
      _mm256_storeu_ps(out + k, e);
      _mm256_storeu_ps(out + k + 8, o);
    }
    for (int64_t k = K16; k < K; ++k) out[k] = bf16_float(xr[k]);
  }
}

// The lane sums of a, b, c and d, in that order.
inline __m128 lane_sums4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// R (1 or 2) rows of xs (split_rows, row stride K) against one weight row w over channels
// [0, K16): s[r] = row r's partial sums. 32 channels a step: two loads of 16 weights, each row's
// 4 FMAs into its own 4 accumulators; each step prefetches the stream STREAM_AHEAD channels on (a
// cache line), across the end of the row into the next.
template <int R>
inline void stream_row(const float* x, int64_t K, int64_t K16, const uint16_t* w, __m256* s) {
  __m256 a0 = _mm256_setzero_ps(), b0 = a0, c0 = a0, d0 = a0;  // row 0: even, odd, even, odd
  __m256 a1 = a0, b1 = a0, c1 = a0, d1 = a0;                    // row 1
  int64_t k = 0;
  for (; k + 32 <= K16; k += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k + STREAM_AHEAD), _MM_HINT_T0);
    __m256 we0, wo0, we1, wo1;
    split16(w + k, we0, wo0);
    split16(w + k + 16, we1, wo1);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), we0, a0);
    b0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), wo0, b0);
    c0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), we1, c0);
    d0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), wo1, d0);
    if (R > 1) {
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + K + k), we0, a1);
      b1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + K + k + 8), wo0, b1);
      c1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + K + k + 16), we1, c1);
      d1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + K + k + 24), wo1, d1);
    }
  }
  if (k < K16) {  // 16 channels left
    __m256 we, wo;
    split16(w + k, we, wo);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), we, a0);
    b0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), wo, b0);
    if (R > 1) {
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + K + k), we, a1);
      b1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + K + k + 8), wo, b1);
    }
  }
  s[0] = _mm256_add_ps(_mm256_add_ps(a0, b0), _mm256_add_ps(c0, d0));
  if (R > 1) s[1] = _mm256_add_ps(_mm256_add_ps(a1, b1), _mm256_add_ps(c1, d1));
}

// Weight rows [n0, n1), one after another in memory order, all M (1 or 2) rows of y from xs
// (split_rows); lane sums 4 weight rows at a time, K's last K % 16 channels by the scalar form.
void streams(const float* xs, int64_t M, int64_t K, int64_t N, const uint16_t* w,
             const uint16_t* bias, int64_t n0, int64_t n1, at::BFloat16* y) {
  const int64_t K16 = K & ~int64_t(15);
  __m256 s[4][2];
  alignas(16) float t[2][4];
  float col[2];
  for (int64_t n = n0; n < n1; n += 4) {
    const int64_t rows = std::min<int64_t>(4, n1 - n);
    for (int64_t j = 0; j < 4; ++j) {
      s[j][0] = s[j][1] = _mm256_setzero_ps();
      if (j >= rows) continue;
      if (M == 2)
        stream_row<2>(xs, K, K16, w + (n + j) * K, s[j]);
      else
        stream_row<1>(xs, K, K16, w + (n + j) * K, s[j]);
    }
    for (int64_t m = 0; m < M; ++m)
      _mm_store_ps(t[m], lane_sums4(s[0][m], s[1][m], s[2][m], s[3][m]));
    for (int64_t j = 0; j < rows; ++j) {
      for (int64_t m = 0; m < M; ++m) col[m] = t[m][j];
      if (K16 < K) dot_scalar(xs, M, K, w, n + j, K16, col);
      finish(col, M, N, n + j, bias, y);
    }
  }
}

// R (1..4) rows of xs (row stride K) against 2 weight rows wb (row stride K), channels
// [0, K16): out[2r + j] = row r's sum against weight row j. Per 16 channels: 2 weight loads and
// 4 ALU ops, then per row 2 loads of x and 4 FMAs into 2 accumulators (8 accumulators, named:
// GCC keeps an array of them on the stack). PREFETCH: the next pair's rows, a cache line of
// each per 32 channels (the first 4 rows read the pair from memory, the others from L1).
template <int R, bool PREFETCH>
inline void split_quad(const float* x, int64_t K, int64_t K16, const uint16_t* wb, float* out) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00;
  __m256 a20 = a00, a21 = a00, a30 = a00, a31 = a00;
  for (int64_t k = 0; k < K16; k += 16) {
    if (PREFETCH && k % 32 == 0) {  // the pair's 64 bytes of these 32 channels, QUAD_AHEAD on
      _mm_prefetch(reinterpret_cast<const char*>(wb + 2 * k + QUAD_AHEAD), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wb + 2 * k + QUAD_AHEAD + 32), _MM_HINT_T0);
    }
    __m256 we0, wo0, we1, wo1;
    split16(wb + k, we0, wo0);
    split16(wb + K + k, we1, wo1);
    __m256 xe = _mm256_loadu_ps(x + k), xo = _mm256_loadu_ps(x + k + 8);
    a00 = _mm256_fmadd_ps(xe, we0, a00), a01 = _mm256_fmadd_ps(xe, we1, a01);
    a00 = _mm256_fmadd_ps(xo, wo0, a00), a01 = _mm256_fmadd_ps(xo, wo1, a01);
    if (R > 1) {
      xe = _mm256_loadu_ps(x + K + k), xo = _mm256_loadu_ps(x + K + k + 8);
      a10 = _mm256_fmadd_ps(xe, we0, a10), a11 = _mm256_fmadd_ps(xe, we1, a11);
      a10 = _mm256_fmadd_ps(xo, wo0, a10), a11 = _mm256_fmadd_ps(xo, wo1, a11);
    }
    if (R > 2) {
      xe = _mm256_loadu_ps(x + 2 * K + k), xo = _mm256_loadu_ps(x + 2 * K + k + 8);
      a20 = _mm256_fmadd_ps(xe, we0, a20), a21 = _mm256_fmadd_ps(xe, we1, a21);
      a20 = _mm256_fmadd_ps(xo, wo0, a20), a21 = _mm256_fmadd_ps(xo, wo1, a21);
    }
    if (R > 3) {
      xe = _mm256_loadu_ps(x + 3 * K + k), xo = _mm256_loadu_ps(x + 3 * K + k + 8);
      a30 = _mm256_fmadd_ps(xe, we0, a30), a31 = _mm256_fmadd_ps(xe, we1, a31);
      a30 = _mm256_fmadd_ps(xo, wo0, a30), a31 = _mm256_fmadd_ps(xo, wo1, a31);
    }
  }
  alignas(16) float t[8];
  _mm_store_ps(t, lane_sums4(a00, a01, a10, a11));
  _mm_store_ps(t + 4, lane_sums4(a20, a21, a30, a31));
  for (int i = 0; i < 2 * R; ++i) out[i] = t[i];
}

template <bool PREFETCH>
inline void split_rows_of(int64_t rows, const float* x, int64_t K, int64_t K16,
                          const uint16_t* wb, float* out) {
  switch (rows) {
    case 1: split_quad<1, PREFETCH>(x, K, K16, wb, out); break;
    case 2: split_quad<2, PREFETCH>(x, K, K16, wb, out); break;
    case 3: split_quad<3, PREFETCH>(x, K, K16, wb, out); break;
    default: split_quad<4, PREFETCH>(x, K, K16, wb, out); break;
  }
}

// Weight pairs [b0, b1) (rows 2b and 2b + 1), all M rows of y, 4 rows of xs (split_rows) at a
// time; K's last K % 16 channels by the scalar form (split_rows leaves them in order).
void split_quads(const float* xs, int64_t M, int64_t K, int64_t N, const uint16_t* w,
                 const uint16_t* bias, int64_t b0, int64_t b1, at::BFloat16* y) {
  const int64_t K16 = K & ~int64_t(15);
  std::vector<float> sums(2 * M), col(M);  // sums [M][2]
  for (int64_t b = b0; b < b1; ++b) {
    const uint16_t* wb = w + b * 2 * K;
    split_rows_of<true>(M, xs, K, K16, wb, sums.data());
    for (int64_t r = 4; r < M; r += 4)
      split_rows_of<false>(M - r, xs + r * K, K, K16, wb, &sums[2 * r]);
    for (int j = 0; j < 2; ++j) {
      for (int64_t m = 0; m < M; ++m) col[m] = sums[2 * m + j];
      if (K16 < K) dot_scalar(xs, M, K, w, 2 * b + j, K16, col.data());
      finish(col.data(), M, N, 2 * b + j, bias, y);
    }
  }
}

// Weight rows [n0, n0 + PC) (rows from N on as zeros), widened to float32 and transposed:
// panel[k * PC + j] = w[n0 + j, k]. 8 x 8 tiles go through registers (unpack, shuffle, lane
// permute); K's last K % 8 channels one at a time.
void pack_panel(const uint16_t* w, int64_t K, int64_t N, int64_t n0, float* panel) {
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t j0 = 0; j0 < PC; j0 += 8) {
    if (n0 + j0 + 8 <= N) {
      for (int64_t k = 0; k < K8; k += 8) {
        __m256 r[8];
        for (int j = 0; j < 8; ++j) r[j] = widen(w + (n0 + j0 + j) * K + k);
        const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
        const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
        const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
        const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
        const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
        const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
        float* out = panel + k * PC + j0;  // channel k + i's 8 weights at out + i * PC
        _mm256_storeu_ps(out + 0 * PC, _mm256_permute2f128_ps(u0, u4, 0x20));
        _mm256_storeu_ps(out + 1 * PC, _mm256_permute2f128_ps(u1, u5, 0x20));
        _mm256_storeu_ps(out + 2 * PC, _mm256_permute2f128_ps(u2, u6, 0x20));
        _mm256_storeu_ps(out + 3 * PC, _mm256_permute2f128_ps(u3, u7, 0x20));
        _mm256_storeu_ps(out + 4 * PC, _mm256_permute2f128_ps(u0, u4, 0x31));
        _mm256_storeu_ps(out + 5 * PC, _mm256_permute2f128_ps(u1, u5, 0x31));
        _mm256_storeu_ps(out + 6 * PC, _mm256_permute2f128_ps(u2, u6, 0x31));
        _mm256_storeu_ps(out + 7 * PC, _mm256_permute2f128_ps(u3, u7, 0x31));
      }
      for (int64_t k = K8; k < K; ++k)
        for (int64_t j = 0; j < 8; ++j)
          panel[k * PC + j0 + j] = bf16_float(w[(n0 + j0 + j) * K + k]);
    } else {
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < 8; ++j)
          panel[k * PC + j0 + j] = n0 + j0 + j < N ? bf16_float(w[(n0 + j0 + j) * K + k]) : 0.0f;
    }
  }
}

// 8 float32 to bfloat16, rounded to nearest even as at::BFloat16 does (a NaN stays a NaN).
inline __m128i to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                                 lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // 32-bit lanes to 16: packus works within 128-bit halves, so pack the halves together
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// R (1..PR) activation rows (x, row stride K) against a packed panel: y[r, n0 + j] for the
// panel's first `cols` weight rows, bias added (b: the panel's 16 bias values as float32).
template <int R>
void micro(const float* x, int64_t K, const float* panel, const float* b, int64_t cols,
           int64_t N, int64_t n0, at::BFloat16* y) {
  __m256 c0[R], c1[R];
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * PC), b1 = _mm256_loadu_ps(panel + k * PC + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * K + k);
      c0[r] = _mm256_fmadd_ps(a, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(a, b1, c1[r]);
    }
  }
  const __m256 bias0 = _mm256_loadu_ps(b), bias1 = _mm256_loadu_ps(b + 8);
  for (int r = 0; r < R; ++r) {
    const __m128i h0 = to_bf16(_mm256_add_ps(c0[r], bias0));
    const __m128i h1 = to_bf16(_mm256_add_ps(c1[r], bias1));
    uint16_t* out = reinterpret_cast<uint16_t*>(y + r * N + n0);
    if (cols == PC) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), h0);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8), h1);
    } else {
      alignas(16) uint16_t tmp[PC];
      _mm_store_si128(reinterpret_cast<__m128i*>(tmp), h0);
      _mm_store_si128(reinterpret_cast<__m128i*>(tmp + 8), h1);
      std::memcpy(out, tmp, cols * sizeof(uint16_t));
    }
  }
}

// Panels [p0, p1) (weight rows p * PC ..), all M rows of y.
void panels(const float* xf, int64_t M, int64_t K, int64_t N, const uint16_t* w,
            const uint16_t* bias, int64_t p0, int64_t p1, at::BFloat16* y) {
  std::vector<float> panel(K * PC);
  float b[PC];
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * PC, cols = std::min(PC, N - n0);
    pack_panel(w, K, N, n0, panel.data());
    for (int64_t j = 0; j < PC; ++j) b[j] = bias && j < cols ? bf16_float(bias[n0 + j]) : 0.0f;
    int64_t m = 0;
    for (; m + PR <= M; m += PR)
      micro<PR>(xf + m * K, K, panel.data(), b, cols, N, n0, y + m * N);
    const float* x = xf + m * K;
    at::BFloat16* ym = y + m * N;
    switch (M - m) {
      case 1: micro<1>(x, K, panel.data(), b, cols, N, n0, ym); break;
      case 2: micro<2>(x, K, panel.data(), b, cols, N, n0, ym); break;
      case 3: micro<3>(x, K, panel.data(), b, cols, N, n0, ym); break;
      case 4: micro<4>(x, K, panel.data(), b, cols, N, n0, ym); break;
      case 5: micro<5>(x, K, panel.data(), b, cols, N, n0, ym); break;
      default: break;
    }
  }
}

}  // namespace wide

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")

// Decode rows on AVX512-BF16 (below DOT_ROWS rows): x stays bfloat16 and each 32-channel step
// is one vdpbf16ps per (activation row, weight row) pair, the bfloat16 pairs' exact products added
// into 16 float32 lanes. Blocks of DB weight rows against DR activation rows at a time (24
// accumulators: 10 loads per 24 products, where 4 x 4 took 8 per 16; the model step x1.06-1.30
// at 8-47 rows, docs/results.md, "Decode's small products on both cores"); a block's first pass
// of rows streams its weights from memory, prefetching them into L2 in memory order (DOT_AHEAD),
// and the later passes find them in L1. K's last K % 32 channels load masked (zeros add
// nothing), by the same step as the others: with a tail step of its own GCC kept the
// accumulators on the stack, stored and reloaded around it (at 4 x 4, a
// quarter of a pass's instructions at K = 576). A row's four lane sums come out of one hadd tree
// and are rounded to bfloat16 four at a time (store4_bf16, at::BFloat16's rounding in vector
// integer ops; the model step x1.03-1.22 at 1-20 rows with both changes, docs/results.md,
// "Decode's small products on both cores"). vdpbf16ps reads subnormal inputs as zero and
// flushes subnormal results (DAZ, FTZ): values below 2^-126 that a float32 product would keep.
// Calls below dot_serial_macs products stay on the calling thread.
namespace dots {

constexpr int64_t DR = 6;  // activation rows per pass
constexpr int64_t DB = 4;  // weight rows per block
// A block's first pass prefetches its weights into L2 in memory order, B cache lines a step (as
// many as the step reads), from (B - 1) * K + DOT_AHEAD channels past the block's start: its last
// row's first line before the step that reads it, then on through the next blocks. Before session
// 66 it prefetched the next block's B rows side by side into L1, and a block read its rows as B
// interleaved runs of 1-3 KB; a Zen 4 read them at 8-13 GB/s, against 20-25 GB/s in order
// (docs/results.md, "AVX512-BF16 dots' weights prefetched in memory order").
constexpr int64_t DOT_AHEAD = 2048;

inline __m512bh load_bh(const uint16_t* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

inline __m512bh load_bh(const uint16_t* p, __mmask32 mask) {
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, p));
}

// R activation rows (x, row stride K) against B weight rows (w, row stride K), channels [0, K):
// acc[r][j] the sums. PREFETCH: the block's memory in its order, into L2 (DOT_AHEAD).
template <int R, int B, bool PREFETCH>
inline void dot_block(const uint16_t* x, int64_t K, const uint16_t* w, float acc[DR][DB]) {
  __m512 a[R][B];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < B; ++j) a[r][j] = _mm512_setzero_ps();
  // One 32-channel step of every (row, weight row) pair; masked: channels [k, K) only, K - k < 32.
  const auto step = [&](int64_t k, bool masked) __attribute__((always_inline)) {
    const __mmask32 mask = masked ? (__mmask32(1) << (K - k)) - 1 : ~__mmask32(0);
    if (PREFETCH && !masked)  // B cache lines a step, as many as the step reads
#pragma GCC unroll 4
      for (int j = 0; j < B; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + (B - 1) * K + DOT_AHEAD + B * k + 32 * j),
                     _MM_HINT_T1);
    __m512bh wv[B];
#pragma GCC unroll 4
    for (int j = 0; j < B; ++j)
      wv[j] = masked ? load_bh(w + j * K + k, mask) : load_bh(w + j * K + k);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = masked ? load_bh(x + r * K + k, mask) : load_bh(x + r * K + k);
#pragma GCC unroll 4
      for (int j = 0; j < B; ++j) a[r][j] = _mm512_dpbf16_ps(a[r][j], xv, wv[j]);
    }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step(k, false);
  if (k < K) step(k, true);
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    if constexpr (B == 4) {  // four lane sums at once: halves added, then two rounds of hadd
      __m256 h[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256d hi = _mm512_extractf64x4_pd(_mm512_castps_pd(a[r][j]), 1);
        h[j] = _mm256_add_ps(_mm512_castps512_ps256(a[r][j]), _mm256_castpd_ps(hi));
      }
      const __m256 q = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
      _mm_storeu_ps(acc[r], _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1)));
    } else {
      for (int j = 0; j < B; ++j) acc[r][j] = _mm512_reduce_add_ps(a[r][j]);
    }
  }
}

// 4 float32 sums plus 4 bias values (bfloat16, or none) rounded to bfloat16 as at::BFloat16
// rounds a float (to nearest even; a NaN becomes 0x7FC0), stored at y: the same bits as
// at::BFloat16(sum + bias) lane by lane.
inline void store4_bf16(__m128 sums, const uint16_t* bias, at::BFloat16* y) {
  if (bias) {
    const __m128i b = _mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bias)));
    sums = _mm_add_ps(sums, _mm_castsi128_ps(_mm_slli_epi32(b, 16)));
  }
  const __m128i u = _mm_castps_si128(sums);
  const __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
  __m128i r = _mm_srli_epi32(_mm_add_epi32(u, _mm_add_epi32(lsb, _mm_set1_epi32(0x7FFF))), 16);
  r = _mm_blendv_epi8(r, _mm_set1_epi32(0x7FC0), _mm_castps_si128(_mm_cmpunord_ps(sums, sums)));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(y), _mm_packus_epi32(r, r));
}

// Rows [m, m + rows) of x (rows <= DR) against B weight rows: dot_block for that row count.
template <int B, bool PREFETCH>
inline void pass(const uint16_t* xm, int64_t rows, int64_t K, const uint16_t* wb,
                 float acc[DR][DB]) {
  switch (rows) {
    case 1: dot_block<1, B, PREFETCH>(xm, K, wb, acc); break;
    case 2: dot_block<2, B, PREFETCH>(xm, K, wb, acc); break;
    case 3: dot_block<3, B, PREFETCH>(xm, K, wb, acc); break;
    case 4: dot_block<4, B, PREFETCH>(xm, K, wb, acc); break;
    case 5: dot_block<5, B, PREFETCH>(xm, K, wb, acc); break;
    default: dot_block<6, B, PREFETCH>(xm, K, wb, acc); break;
  }
}

// All M rows against B weight rows from n: rows DR at a time, the first pass with `prefetch`.
template <int B>
void rows_against(const uint16_t* x, int64_t M, int64_t K, int64_t N, const uint16_t* w,
                  const uint16_t* bias, int64_t n, bool prefetch, at::BFloat16* y) {
  float acc[DR][DB];
  const uint16_t* wb = w + n * K;
  for (int64_t m = 0; m < M; m += DR) {
    const int64_t rows = std::min(DR, M - m);
    if (prefetch && m == 0)
      pass<B, true>(x + m * K, rows, K, wb, acc);
    else
      pass<B, false>(x + m * K, rows, K, wb, acc);
    if constexpr (B == 4) {
      for (int64_t r = 0; r < rows; ++r)
        store4_bf16(_mm_loadu_ps(acc[r]), bias ? bias + n : nullptr, y + (m + r) * N + n);
    } else {
      for (int64_t r = 0; r < rows; ++r)
        for (int j = 0; j < B; ++j) {
          const float b = bias ? bf16_float(bias[n + j]) : 0.0f;
          y[(m + r) * N + n + j] = at::BFloat16(acc[r][j] + b);
        }
    }
  }
}

// Weight blocks [b0, b1) (rows b * DB ..), all M rows of y; the caller runs the last N % DB rows.
void blocks(const uint16_t* x, int64_t M, int64_t K, int64_t N, const uint16_t* w,
            const uint16_t* bias, int64_t b0, int64_t b1, at::BFloat16* y) {
  for (int64_t b = b0; b < b1; ++b)
    rows_against<DB>(x, M, K, N, w, bias, b * DB, true, y);
}

void tail(const uint16_t* x, int64_t M, int64_t K, int64_t N, const uint16_t* w,
          const uint16_t* bias, int64_t n0, at::BFloat16* y) {
  for (int64_t n = n0; n < N; ++n) rows_against<1>(x, M, K, N, w, bias, n, false, y);
}

}  // namespace dots

#pragma GCC pop_options

// The forms follow the attention's ISA variant (bindings.cpp's one choice: the best this CPU
// runs, or RAGGED_NATIVE_ISA's, an unknown value refused): AVX2 + FMA on every variant but
// scalar, and the vdpbf16ps dots on avx512 and amx (AVX-512 F/BW/VL with BF16).
bool has_avx2() {
  static const bool yes = isa_name() != "scalar";
  return yes;
}

bool has_bf16_dots() {
  static const bool yes = isa_name() == "avx512" || isa_name() == "amx";
  return yes;
}

}  // namespace

std::string linear_isa() {
  return has_bf16_dots() ? "avx512_bf16" : has_avx2() ? "avx2" : "scalar";
}

int64_t linear_dot_rows() { return has_bf16_dots() ? DOT_ROWS : 0; }

void set_linear_dot_serial_macs(int64_t macs) {
  TORCH_CHECK(macs >= 0, "set_linear_dot_serial_macs: ", macs, " products is negative");
  dot_serial_macs.store(macs, std::memory_order_relaxed);
}

int64_t linear_dot_serial_macs() { return dot_serial_macs.load(std::memory_order_relaxed); }

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  const char* who = "linear_bf16";
  check_cpu_tensor(who, weight, "weight", at::kBFloat16, 2);
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16, who,
              ": x must be a bfloat16 CPU tensor, got ", x.scalar_type(), " on ", x.device());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, who, ": x's last dim must be the weight's ", K,
              " input features, got x of shape ", x.sizes());
  const uint16_t* bias_ptr = nullptr;
  if (bias && bias->defined()) {
    check_cpu_tensor(who, *bias, "bias", at::kBFloat16, 1);
    TORCH_CHECK(bias->size(0) == N, who, ": bias must have the weight's ", N,
                " output features, got ", bias->size(0));
    bias_ptr = reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>());
  }
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty(out_shape, x.options());
  const int64_t M = y.numel() / std::max<int64_t>(N, 1);
  if (M == 0 || N == 0) return y;
  if (K == 0) return bias_ptr ? y.copy_(bias->expand_as(y)) : y.zero_();  // empty sums
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();

  // parallel_for's grain over `units` of `rows` weight rows each: all of them on the calling
  // thread below `serial` products in all, else about SERIAL_MACS products a task.
  const auto grain = [&](int64_t units, int64_t rows, int64_t serial = SERIAL_MACS) {
    if (M * N * K < serial) return std::max<int64_t>(units, 1);
    return std::max<int64_t>(1, SERIAL_MACS / std::max<int64_t>(rows * K * M, 1));
  };
  if (has_bf16_dots() && M < DOT_ROWS) {  // x as it is, bfloat16
    const at::Tensor xb = x.reshape({M, K}).contiguous();
    const uint16_t* xq = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
    const int64_t n_dot = N / dots::DB;
    const int64_t g = grain(n_dot, dots::DB, dot_serial_macs.load(std::memory_order_relaxed));
    pool::parallel_for(0, n_dot, g, [&](int64_t b0, int64_t b1) {
      dots::blocks(xq, M, K, N, wp, bias_ptr, b0, b1, yp);
    });
    dots::tail(xq, M, K, N, wp, bias_ptr, n_dot * dots::DB, yp);
    return y;
  }
  if (has_avx2() && M < PANEL_ROWS) {
    const at::Tensor xb = x.reshape({M, K}).contiguous();
    const at::Tensor xs = at::empty({M, K}, x.options().dtype(at::kFloat));
    float* xsp = xs.data_ptr<float>();
    wide::split_rows(reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>()), M, K, xsp);
    if (M < QUAD_ROWS) {
      pool::parallel_for(0, N, grain(N, 1), [&](int64_t n0, int64_t n1) {
        wide::streams(xsp, M, K, N, wp, bias_ptr, n0, n1, yp);
      });
      return y;
    }
    const int64_t n_pairs = N / 2;
    pool::parallel_for(0, n_pairs, grain(n_pairs, 2), [&](int64_t b0, int64_t b1) {
      wide::split_quads(xsp, M, K, N, wp, bias_ptr, b0, b1, yp);
    });
    rows_split_scalar(xsp, M, K, N, wp, bias_ptr, n_pairs * 2, N, yp);
    return y;
  }
  const at::Tensor xf = x.reshape({M, K}).to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const int64_t n_panels = (N + PC - 1) / PC;
  if (has_avx2()) {
    pool::parallel_for(0, n_panels, grain(n_panels, PC), [&](int64_t p0, int64_t p1) {
      wide::panels(xp, M, K, N, wp, bias_ptr, p0, p1, yp);
    });
  } else {
    pool::parallel_for(0, N, grain(N, 1), [&](int64_t n0, int64_t n1) {
      rows_scalar(xp, M, K, N, wp, bias_ptr, n0, n1, yp);
    });
  }
  return y;
}

}  // namespace ragged
