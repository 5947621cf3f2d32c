// The window statistics of a batch's tail pages in one call per layer: the native form of
// tail_batch.window_stats (the torch form stays the reference of these sums).
//
// Page m of the batch's tail pages (tail_batch.TailBatch) saw the window queries of its request,
// rows win_row[m, j] of q at positions win_pos[m, j] (-1: no such query). Per KV head h and
// token i of the page, attn[m, h, i] sums over the window queries that saw the token (its
// position page_start[m] + i <= win_pos[m, j]) the largest softmax probability among h's query
// heads, exp(q . k * scale - lse); q_sum, q_sq_sum pool those queries (all of h's query heads)
// that reached the page (win_pos[m, j] >= page_start[m]), q_count counts them. What the page's
// staging page accumulated before (prior_stage[m] >= 0, row of the staging statistics; its first
// n_staged[m] tokens' attn) is added. Only reads: the caller stores the result through the
// storage's write API. No dequantization, no temporaries beyond the four outputs (and one
// scratch buffer per parallel chunk). Three forms of the per (page, KV head) loop (page_form):
// the portable one (std::exp, the attention's scalar variant, and head sizes the others cannot
// tile), an AVX-512 one (wide::, taken when the attention runs avx512 or amx and head_dim is a
// multiple of 16) and an AVX2 one (narrow::, the attention's avx2 variant, or avx512 and amx
// where head_dim is a multiple of 8 but not of 16): keys tile-transposed once per page and head
// (float32), 16 or 8 keys per vector, one exp per key of the query heads' largest exponent by a
// degree-7 polynomial (relative error < 2e-7 against std::exp).
//
// gather_pages(k_stage, v_stage, pages, rows): a decode step's tail pages read back from the
// layer's staging pages (tail_batch.stage_fresh), only each page's first rows[m] tokens copied
// (those its request holds; the rest zeros): half the bytes of index_select's whole pages on
// average, and the copy is what the step waits on.
//
// store_stats: one layer's accumulators of the pages that stay staged into the staging statistics
// (StagingStats.store's four index_copy_ in one call, RaggedStorage.store_stats on the CPU).
//
// copy_rows(dst, slots, src, rows): dst[slots[i]] = src[rows[i]] (zeros where rows[i] < 0),
// rows of any dtype by memcpy (the staging write of a decode step, RaggedStorage.stage_tokens,
// where torch's gather and index_copy_ cost ~60 us for a few hundred rows of 384 bytes).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <immintrin.h>

#include "checks.h"
#include "pool.h"
#include "tails.h"

namespace ragged {
namespace {

void check(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim) {
  check_cpu_tensor("window_stats", t, name, dtype, dim);
}

struct Shapes {
  int64_t M, P, H, D, G, w, L;
};

// Tokens [0, reach) of page m some window query sees.
int64_t page_reach(const Shapes& s, int64_t m, const int64_t* win_pos, int64_t page_start) {
  int64_t reach = 0;
  for (int64_t j = 0; j < s.w; ++j)
    reach = std::max(reach, std::min(s.P, win_pos[m * s.w + j] - page_start + 1));
  return reach;
}

// Floats of page_head's scratch (either form): keys [Pp, D] (Pp: P in whole 16-key tiles),
// queries [G, D], lse [G] and best [P].
int64_t scratch_floats(const Shapes& s) {
  return (s.P + 15) / 16 * 16 * s.D + s.G * s.D + s.G + s.P;
}

// One (page m, KV head h): attn[P], q_sum[D], q_sq[D] of the outputs (portable form).
template <typename T>
void page_head(const Shapes& s, int64_t m, int64_t h, const T* q, const float* lse, const T* k,
               const int64_t* win_row, const int64_t* win_pos, int64_t page_start, float scale,
               float* attn, float* q_sum, float* q_sq, float* scratch) {
  const int64_t P = s.P, D = s.D, G = s.G, Hq = s.H * s.G;
  float *keys = scratch, *qf = scratch + P * D, *best = qf + D;  // [P, D], [D], [P]
  const int64_t reach = page_reach(s, m, win_pos, page_start);
  for (int64_t i = 0; i < reach; ++i)  // those keys of head h in float32
    for (int64_t d = 0; d < D; ++d)
      keys[i * D + d] = static_cast<float>(k[((m * P + i) * s.H + h) * D + d]);
  std::fill(attn, attn + P, 0.f);
  std::fill(q_sum, q_sum + D, 0.f);
  std::fill(q_sq, q_sq + D, 0.f);
  for (int64_t j = 0; j < s.w; ++j) {
    const int64_t pos = win_pos[m * s.w + j];
    if (pos < page_start) continue;  // no such query, or it precedes the page
    const int64_t row = win_row[m * s.w + j];
    const int64_t seen = std::min(P, pos - page_start + 1);  // tokens [0, seen) are causal
    std::fill(best, best + seen, 0.f);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t qh = h * G + g;
      const T* qrow = q + (row * Hq + qh) * D;
      for (int64_t d = 0; d < D; ++d) {
        qf[d] = static_cast<float>(qrow[d]);
        q_sum[d] += qf[d];
        q_sq[d] += qf[d] * qf[d];
      }
      const float norm = lse[row * Hq + qh];
      for (int64_t i = 0; i < seen; ++i) {
        const float* key = keys + i * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qf[d] * key[d];
        best[i] = std::max(best[i], std::exp(dot * scale - norm));
      }
    }
    for (int64_t i = 0; i < seen; ++i) attn[i] += best[i];
  }
}

// ---- AVX-512 form (window_stats picks it when the attention runs its avx512 or amx variant) ----
// Keys of (m, h) are converted to float32 and tile-transposed once, kt [Pp / 16, D, 16] (lane:
// key). A window query's G rows (up to 3 at once) are dotted against up to 4 tiles (64 keys)
// by broadcast FMAs over the D channels; the max over the rows of the exponents, then one
// exp16 per key, stay in registers; the causal limit `seen` masks the lanes added to attn.
// Needs D a multiple of 16. (bfloat16 keys dotted in channel pairs by vdpbf16ps measured no
// faster than converted keys here: not used.)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

namespace wide {

// exp(x) on 16 lanes: exp_approx's reduction and degree-7 polynomial (relative error < 2e-7;
// x clamped to [-87, 88]). attention_body.inc's exp16 is the degree-5 form.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693145752f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(1.42860677e-6f)));
  __m512 e = _mm512_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(c));
  const __m512i pow2 =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(e, _mm512_castsi512_ps(pow2));
}

// The first k of 16 lanes (none for k <= 0).
inline __mmask16 first_lanes(int64_t k) {
  if (k <= 0) return __mmask16(0);
  return k >= 16 ? __mmask16(0xffff) : __mmask16((1u << k) - 1);
}

// 16 values at p as float32 (bfloat16: a 16-bit shift).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

// r[i] (row i: 16 floats) -> r[c] = column c, in place.
inline void transpose16(__m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: rows (i, i+1) interleaved
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + k], lane L: column 4L + k of rows i..i+3
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 2]);
    const __m512d c = _mm512_castps_pd(t[i + 1]), d = _mm512_castps_pd(t[i + 3]);
    u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int k = 0; k < 4; ++k) {  // gather lane L of u[k], u[4 + k], u[8 + k], u[12 + k]
    const __m512 v0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88);   // cols k, 8+k of rows 0-7
    const __m512 v1 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xdd);   // cols 4+k, 12+k
    const __m512 w0 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);  // of rows 8-15
    const __m512 w1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xdd);
    r[k] = _mm512_shuffle_f32x4(v0, w0, 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(v0, w0, 0xdd);
    r[4 + k] = _mm512_shuffle_f32x4(v1, w1, 0x88);
    r[12 + k] = _mm512_shuffle_f32x4(v1, w1, 0xdd);
  }
}

// Keys [0, reach) of (m, h) into kt [ceil(reach / 16), D, 16] float32 (missing keys: zeros).
template <typename T>
void tile_keys(const Shapes& s, int64_t m, int64_t h, const T* k, int64_t reach, float* kt) {
  const int64_t D = s.D;
  __m512 r[16];
  for (int64_t t0 = 0; t0 < reach; t0 += 16) {
    float* tile = kt + t0 * D;  // [D, 16]
    for (int64_t c0 = 0; c0 < D; c0 += 16) {
      for (int64_t i = 0; i < 16; ++i)
        r[i] = t0 + i < reach ? load16(k + ((m * s.P + t0 + i) * s.H + h) * D + c0)
                              : _mm512_setzero_ps();
      transpose16(r);
      for (int64_t c = 0; c < 16; ++c) _mm512_storeu_ps(tile + (c0 + c) * 16, r[c]);
    }
  }
}

// best[t] = max(best[t], max over rows i < RB of scale qf[i] . key - norm[i]) for the 16 keys
// of each of NT tiles at kt (qf: [RB, D] float32, norm: [RB]).
template <int NT, int RB>
void rows_tiles(const float* kt, int64_t D, const float* qf, const float* norm, float scale,
                __m512* best) {
  __m512 acc[RB][NT];
  for (int i = 0; i < RB; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; ++c) {
    __m512 key[NT];
    for (int t = 0; t < NT; ++t) {
      key[t] = _mm512_loadu_ps(kt + (t * D + c) * 16);
      asm("" : "+v"(key[t]));  // held in a register: loaded once for the RB rows, not RB times
    }
    for (int i = 0; i < RB; ++i) {
      const __m512 x = _mm512_set1_ps(qf[i * D + c]);
      for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_fmadd_ps(x, key[t], acc[i][t]);
    }
  }
  const __m512 vs = _mm512_set1_ps(scale);
  for (int i = 0; i < RB; ++i) {
    const __m512 vn = _mm512_set1_ps(norm[i]);
    for (int t = 0; t < NT; ++t)
      best[t] = _mm512_max_ps(best[t], _mm512_fmsub_ps(acc[i][t], vs, vn));
  }
}

using RowsTiles = void (*)(const float*, int64_t, const float*, const float*, float, __m512*);
constexpr RowsTiles kRowsTiles[4][3] = {
    {rows_tiles<1, 1>, rows_tiles<1, 2>, rows_tiles<1, 3>},
    {rows_tiles<2, 1>, rows_tiles<2, 2>, rows_tiles<2, 3>},
    {rows_tiles<3, 1>, rows_tiles<3, 2>, rows_tiles<3, 3>},
    {rows_tiles<4, 1>, rows_tiles<4, 2>, rows_tiles<4, 3>}};

// qf [G, D] = window query `row`'s query heads of h in float32, pooled into q_sum / q_sq;
// norm [G] their lse.
template <typename T>
void window_rows(const Shapes& s, int64_t h, int64_t row, const T* q, const float* lse,
                 float* qf, float* norm, float* q_sum, float* q_sq) {
  const int64_t D = s.D, Hq = s.H * s.G;
  for (int64_t g = 0; g < s.G; ++g) {
    const int64_t qh = h * s.G + g;
    const T* qrow = q + (row * Hq + qh) * D;
    for (int64_t c = 0; c < D; c += 16) {
      const __m512 x = load16(qrow + c);
      _mm512_storeu_ps(qf + g * D + c, x);
      _mm512_storeu_ps(q_sum + c, _mm512_add_ps(_mm512_loadu_ps(q_sum + c), x));
      _mm512_storeu_ps(q_sq + c, _mm512_fmadd_ps(x, x, _mm512_loadu_ps(q_sq + c)));
    }
    norm[g] = lse[row * Hq + qh];
  }
}

// attn[i] += max over the G rows of exp(scale qf[g] . key_i - norm[g]) for i < seen: one exp
// of the rows' largest exponent per key (exp is increasing).
void window_attn(int64_t G, int64_t D, const float* kt, const float* qf, const float* norm,
                 float scale, int64_t seen, float* attn) {
  const int64_t tiles = (seen + 15) / 16;
  for (int64_t t0 = 0; t0 < tiles; t0 += 4) {
    const int64_t nt = std::min<int64_t>(4, tiles - t0);
    __m512 best[4];
    for (__m512& b : best) b = _mm512_set1_ps(-INFINITY);
    for (int64_t g0 = 0; g0 < G; g0 += 3)
      kRowsTiles[nt - 1][std::min<int64_t>(3, G - g0) - 1](kt + t0 * D * 16, D, qf + g0 * D,
                                                           norm + g0, scale, best);
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t at = (t0 + t) * 16;
      const __mmask16 in = first_lanes(seen - at);
      _mm512_mask_storeu_ps(attn + at, in,
                            _mm512_add_ps(_mm512_maskz_loadu_ps(in, attn + at), exp16(best[t])));
    }
  }
}

// page_head (above) in AVX-512: the same sums, exp by exp16.
template <typename T>
void page_head(const Shapes& s, int64_t m, int64_t h, const T* q, const float* lse, const T* k,
               const int64_t* win_row, const int64_t* win_pos, int64_t page_start, float scale,
               float* attn, float* q_sum, float* q_sq, float* scratch) {
  const int64_t P = s.P, D = s.D, Pp = (P + 15) / 16 * 16;
  float *kt = scratch, *qf = kt + Pp * D, *norm = qf + s.G * D;  // [Pp/16, D, 16], [G, D], [G]
  tile_keys(s, m, h, k, page_reach(s, m, win_pos, page_start), kt);
  std::fill(attn, attn + P, 0.f);
  std::fill(q_sum, q_sum + D, 0.f);
  std::fill(q_sq, q_sq + D, 0.f);
  for (int64_t j = 0; j < s.w; ++j) {
    const int64_t pos = win_pos[m * s.w + j];
    if (pos < page_start) continue;  // no such query, or it precedes the page
    window_rows(s, h, win_row[m * s.w + j], q, lse, qf, norm, q_sum, q_sq);
    window_attn(s.G, D, kt, qf, norm, scale, std::min(P, pos - page_start + 1), attn);
  }
}

}  // namespace wide

#pragma GCC pop_options

// ---- AVX2 form (window_stats picks it when the attention runs its avx2 variant, or where
// head_dim is a multiple of 8 but not of 16 on avx512 and amx) ----
// The AVX-512 form on 8 lanes: keys tile-transposed once per page and head, kt [Pp / 8, D, 8]
// (Pp: the keys some query sees, in whole 8-key tiles); up to 3 rows of a window query dotted
// against up to 3 tiles (24 keys) by broadcast FMAs, 9 accumulators, 3 keys and a broadcast in
// 13 of the 16 registers; one exp8 (wide::exp16's polynomial) per key of the rows' largest
// exponent.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace narrow {

// exp(x) on 8 lanes: wide::exp16's steps (relative error < 2e-7; x clamped to [-87, 88]).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145752f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(1.42860677e-6f)));
  __m256 e = _mm256_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(c));
  const __m256i pow2 =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(e, _mm256_castsi256_ps(pow2));
}

// The first k of 8 lanes (all bits set), for maskload / maskstore.
inline __m256i first_lanes(int64_t k) {
  const int n = static_cast<int>(std::clamp<int64_t>(k, 0, 8));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// 8 values at p as float32 (bfloat16: a 16-bit shift).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}

// r[i] (row i: 8 floats) -> r[c] = column c, in place.
inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {  // per 128-bit lane: rows (i, i+1) interleaved
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // u[i + k], lane L: column 4L + k of rows i..i+3
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int k = 0; k < 4; ++k) {  // the low lanes of rows 0-3 and 4-7 join: columns k and 4 + k
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}

// Keys [0, reach) of (m, h) into kt [ceil(reach / 8), D, 8] float32 (missing keys: zeros).
template <typename T>
void tile_keys(const Shapes& s, int64_t m, int64_t h, const T* k, int64_t reach, float* kt) {
  const int64_t D = s.D;
  __m256 r[8];
  for (int64_t t0 = 0; t0 < reach; t0 += 8) {
    float* tile = kt + t0 * D;  // [D, 8]
    for (int64_t c0 = 0; c0 < D; c0 += 8) {
      for (int64_t i = 0; i < 8; ++i)
        r[i] = t0 + i < reach ? load8(k + ((m * s.P + t0 + i) * s.H + h) * D + c0)
                              : _mm256_setzero_ps();
      transpose8(r);
      for (int64_t c = 0; c < 8; ++c) _mm256_storeu_ps(tile + (c0 + c) * 8, r[c]);
    }
  }
}

// best[t] = max(best[t], max over rows i < RB of scale qf[i] . key - norm[i]) for the 8 keys
// of each of NT tiles at kt (qf: [RB, D] float32, norm: [RB]). The accumulators are named
// variables: GCC keeps an array of them in registers but also stores it to the stack every
// channel (9 extra stores per 9 FMAs; attention_body.inc's column_rows says the same).
template <int NT, int RB>
void rows_tiles(const float* kt, int64_t D, const float* qf, const float* norm, float scale,
                __m256* best) {
  static_assert(NT <= 3 && RB <= 3, "rows_tiles: more registers than AVX2 has");
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00,
         a20 = a00, a21 = a00, a22 = a00;
  for (int64_t c = 0; c < D; ++c) {
    const __m256 k0 = _mm256_loadu_ps(kt + c * 8);
    const __m256 k1 = NT > 1 ? _mm256_loadu_ps(kt + (D + c) * 8) : k0;
    const __m256 k2 = NT > 2 ? _mm256_loadu_ps(kt + (2 * D + c) * 8) : k0;
#define RAGGED_TILE(i, t) \
  if constexpr (NT > t) a##i##t = _mm256_fmadd_ps(x, k##t, a##i##t);
#define RAGGED_ROW(i)                                       \
  if constexpr (RB > i) {                                   \
    const __m256 x = _mm256_broadcast_ss(qf + i * D + c);   \
    RAGGED_TILE(i, 0) RAGGED_TILE(i, 1) RAGGED_TILE(i, 2)   \
  }
    RAGGED_ROW(0) RAGGED_ROW(1) RAGGED_ROW(2)
#undef RAGGED_ROW
#undef RAGGED_TILE
  }
  const __m256 acc[3][3] = {{a00, a01, a02}, {a10, a11, a12}, {a20, a21, a22}};
  const __m256 vs = _mm256_set1_ps(scale);
  for (int i = 0; i < RB; ++i) {
    const __m256 vn = _mm256_set1_ps(norm[i]);
    for (int t = 0; t < NT; ++t)
      best[t] = _mm256_max_ps(best[t], _mm256_fmsub_ps(acc[i][t], vs, vn));
  }
}

using RowsTiles = void (*)(const float*, int64_t, const float*, const float*, float, __m256*);
constexpr RowsTiles kRowsTiles[3][3] = {
    {rows_tiles<1, 1>, rows_tiles<1, 2>, rows_tiles<1, 3>},
    {rows_tiles<2, 1>, rows_tiles<2, 2>, rows_tiles<2, 3>},
    {rows_tiles<3, 1>, rows_tiles<3, 2>, rows_tiles<3, 3>}};

// qf [G, D] = window query `row`'s query heads of h in float32, pooled into q_sum / q_sq;
// norm [G] their lse.
template <typename T>
void window_rows(const Shapes& s, int64_t h, int64_t row, const T* q, const float* lse,
                 float* qf, float* norm, float* q_sum, float* q_sq) {
  const int64_t D = s.D, Hq = s.H * s.G;
  for (int64_t g = 0; g < s.G; ++g) {
    const int64_t qh = h * s.G + g;
    const T* qrow = q + (row * Hq + qh) * D;
    for (int64_t c = 0; c < D; c += 8) {
      const __m256 x = load8(qrow + c);
      _mm256_storeu_ps(qf + g * D + c, x);
      _mm256_storeu_ps(q_sum + c, _mm256_add_ps(_mm256_loadu_ps(q_sum + c), x));
      _mm256_storeu_ps(q_sq + c, _mm256_fmadd_ps(x, x, _mm256_loadu_ps(q_sq + c)));
    }
    norm[g] = lse[row * Hq + qh];
  }
}

// attn[i] += max over the G rows of exp(scale qf[g] . key_i - norm[g]) for i < seen: one exp
// of the rows' largest exponent per key (exp is increasing).
void window_attn(int64_t G, int64_t D, const float* kt, const float* qf, const float* norm,
                 float scale, int64_t seen, float* attn) {
  const int64_t tiles = (seen + 7) / 8;
  for (int64_t t0 = 0; t0 < tiles; t0 += 3) {
    const int64_t nt = std::min<int64_t>(3, tiles - t0);
    __m256 best[3];
    for (__m256& b : best) b = _mm256_set1_ps(-INFINITY);
    for (int64_t g0 = 0; g0 < G; g0 += 3)
      kRowsTiles[nt - 1][std::min<int64_t>(3, G - g0) - 1](kt + t0 * D * 8, D, qf + g0 * D,
                                                           norm + g0, scale, best);
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t at = (t0 + t) * 8;
      const __m256i in = first_lanes(seen - at);
      _mm256_maskstore_ps(attn + at, in,
                          _mm256_add_ps(_mm256_maskload_ps(attn + at, in), exp8(best[t])));
    }
  }
}

// page_head (the portable form above) in AVX2: the same sums, exp by exp8.
template <typename T>
void page_head(const Shapes& s, int64_t m, int64_t h, const T* q, const float* lse, const T* k,
               const int64_t* win_row, const int64_t* win_pos, int64_t page_start, float scale,
               float* attn, float* q_sum, float* q_sq, float* scratch) {
  const int64_t P = s.P, D = s.D, Pp = (P + 7) / 8 * 8;
  float *kt = scratch, *qf = kt + Pp * D, *norm = qf + s.G * D;  // [Pp/8, D, 8], [G, D], [G]
  tile_keys(s, m, h, k, page_reach(s, m, win_pos, page_start), kt);
  std::fill(attn, attn + P, 0.f);
  std::fill(q_sum, q_sum + D, 0.f);
  std::fill(q_sq, q_sq + D, 0.f);
  for (int64_t j = 0; j < s.w; ++j) {
    const int64_t pos = win_pos[m * s.w + j];
    if (pos < page_start) continue;  // no such query, or it precedes the page
    window_rows(s, h, win_row[m * s.w + j], q, lse, qf, norm, q_sum, q_sq);
    window_attn(s.G, D, kt, qf, norm, scale, std::min(P, pos - page_start + 1), attn);
  }
}

}  // namespace narrow

#pragma GCC pop_options

// Which form of page_head a call takes: the attention's ISA variant (bindings.cpp's choice,
// RAGGED_NATIVE_ISA included) and what head_dim allows (wide: a multiple of 16; narrow: of 8).
enum class Form { kPortable, kNarrow, kWide };

Form page_form(int64_t D) {
  static const std::string name = isa_name();
  const bool avx512 = name == "avx512" || name == "amx";
  if (avx512 && D % 16 == 0) return Form::kWide;
  if ((avx512 || name == "avx2") && D % 8 == 0) return Form::kNarrow;
  return Form::kPortable;
}

template <typename T>
void run(const Shapes& s, const at::Tensor& q, const at::Tensor& lse, const at::Tensor& k_pages,
         const at::Tensor& win_row, const at::Tensor& win_pos, const at::Tensor& page_start,
         const at::Tensor& n_staged, const at::Tensor& prior_stage,
         const std::vector<at::Tensor>& prior, int64_t layer, double scale,
         const std::vector<at::Tensor>& out, Form form) {
  const T* qp = q.data_ptr<T>();
  const T* kp = k_pages.data_ptr<T>();
  const float* lp = lse.data_ptr<float>();
  const int64_t *rows = win_row.data_ptr<int64_t>(), *pos = win_pos.data_ptr<int64_t>();
  const int64_t *start = page_start.data_ptr<int64_t>(), *staged = n_staged.data_ptr<int64_t>();
  const int64_t* stage = prior_stage.data_ptr<int64_t>();
  const float *p_attn = prior[0].data_ptr<float>(), *p_sum = prior[1].data_ptr<float>();
  const float *p_sq = prior[2].data_ptr<float>(), *p_cnt = prior[3].data_ptr<float>();
  float *attn = out[0].data_ptr<float>(), *q_sum = out[1].data_ptr<float>();
  float *q_sq = out[2].data_ptr<float>(), *q_cnt = out[3].data_ptr<float>();
  const int64_t P = s.P, D = s.D, H = s.H;
  // The staging statistics the pages held, toward the cache all at once: rows of scattered
  // staging pages (cold by a decode step's next visit to this layer) that the loop below would
  // otherwise miss on one page after another.
  for (int64_t m = 0; m < s.M; ++m) {
    if (stage[m] < 0) continue;
    const int64_t at = stage[m] * s.L + layer;
    for (int64_t i = 0; i < H * P; i += 16) __builtin_prefetch(p_attn + at * H * P + i);
    for (int64_t i = 0; i < H * D; i += 16) {
      __builtin_prefetch(p_sum + at * H * D + i);
      __builtin_prefetch(p_sq + at * H * D + i);
    }
  }
  const int64_t cost = std::max<int64_t>(1, s.w * s.G * P * D);
  pool::parallel_for(0, s.M * H, std::max<int64_t>(1, (1 << 16) / cost), [&](int64_t b, int64_t e) {
    std::vector<float> scratch(scratch_floats(s));  // page_head's buffers
    const auto head = form == Form::kWide     ? &wide::page_head<T>
                      : form == Form::kNarrow ? &narrow::page_head<T>
                                              : &page_head<T>;
    for (int64_t mh = b; mh < e; ++mh) {
      const int64_t m = mh / H, h = mh % H;
      float *a = attn + mh * P, *sm = q_sum + mh * D, *sq = q_sq + mh * D;
      head(s, m, h, qp, lp, kp, rows, pos, start[m], static_cast<float>(scale), a, sm, sq,
           scratch.data());
      if (stage[m] < 0) continue;
      const int64_t at = stage[m] * s.L + layer;  // row of [S + 1, L, ...]
      const float* pa = p_attn + (at * H + h) * P;
      for (int64_t i = 0; i < std::min(P, staged[m]); ++i) a[i] += pa[i];
      const float *ps = p_sum + (at * H + h) * D, *pq = p_sq + (at * H + h) * D;
      for (int64_t d = 0; d < D; ++d) {
        sm[d] += ps[d];
        sq[d] += pq[d];
      }
    }
  });
  for (int64_t m = 0; m < s.M; ++m) {
    int64_t saw = 0;
    for (int64_t j = 0; j < s.w; ++j) saw += pos[m * s.w + j] >= start[m];
    q_cnt[m] = static_cast<float>(saw * s.G);
    if (stage[m] >= 0) q_cnt[m] += p_cnt[stage[m] * s.L + layer];
  }
}

}  // namespace

std::vector<at::Tensor> window_stats(const at::Tensor& q, const at::Tensor& lse,
                                     const at::Tensor& k_pages, const at::Tensor& win_row,
                                     const at::Tensor& win_pos, const at::Tensor& page_start,
                                     const at::Tensor& n_staged, const at::Tensor& prior_stage,
                                     const at::Tensor& attn, const at::Tensor& q_sum,
                                     const at::Tensor& q_sq_sum, const at::Tensor& q_count,
                                     int64_t layer, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "window_stats: q must be float32 or bfloat16, got ", q.scalar_type());
  check(q, "q", q.scalar_type(), 3);
  check(k_pages, "k_pages (same dtype as q)", q.scalar_type(), 4);
  check(lse, "lse", at::kFloat, 2);
  check(win_row, "win_row", at::kLong, 2);
  check(win_pos, "win_pos", at::kLong, 2);
  for (auto [t, name] : {std::pair{&page_start, "page_start"}, {&n_staged, "n_staged"},
                         {&prior_stage, "prior_stage"}})
    check(*t, name, at::kLong, 1);
  check(attn, "stats.attn", at::kFloat, 4);
  check(q_sum, "stats.q_sum", at::kFloat, 4);
  check(q_sq_sum, "stats.q_sq_sum", at::kFloat, 4);
  check(q_count, "stats.q_count", at::kFloat, 2);
  Shapes s{k_pages.size(0), k_pages.size(1), k_pages.size(2), k_pages.size(3), 0,
           win_row.size(1), attn.size(1)};
  TORCH_CHECK(q.size(2) == s.D && q.size(1) % s.H == 0, "window_stats: q ", q.sizes(),
              " does not match k_pages ", k_pages.sizes(), " (head_dim, query heads per KV head)");
  s.G = q.size(1) / s.H;
  TORCH_CHECK(lse.size(0) == q.size(0) && lse.size(1) == q.size(1), "window_stats: lse ",
              lse.sizes(), " must be [N, H_q] of q ", q.sizes());
  for (const at::Tensor* t : {&win_row, &win_pos})
    TORCH_CHECK(t->size(0) == s.M && t->size(1) == s.w, "window_stats: window tables ",
                t->sizes(), " must be [M, w] with M = ", s.M, " tail pages");
  for (const at::Tensor* t : {&page_start, &n_staged, &prior_stage})
    TORCH_CHECK(t->size(0) == s.M, "window_stats: per-page tables must have M = ", s.M,
                " entries, got ", t->sizes());
  TORCH_CHECK(layer >= 0 && layer < s.L, "window_stats: layer ", layer, " outside [0, ", s.L, ")");
  TORCH_CHECK(attn.size(2) == s.H && attn.size(3) == s.P && q_sum.size(3) == s.D,
              "window_stats: staging statistics ", attn.sizes(), " / ", q_sum.sizes(),
              " do not match k_pages ", k_pages.sizes());
  const int64_t rows = q.size(0), stages = attn.size(0);
  const int64_t *r = win_row.data_ptr<int64_t>(), *p = win_pos.data_ptr<int64_t>();
  const int64_t* st = prior_stage.data_ptr<int64_t>();
  for (int64_t m = 0; m < s.M; ++m) {
    TORCH_CHECK(st[m] < stages, "window_stats: prior_stage ", st[m], " of page ", m,
                " is not a staging page (", stages, " rows)");
    for (int64_t j = 0; j < s.w; ++j)
      TORCH_CHECK(p[m * s.w + j] < 0 || (r[m * s.w + j] >= 0 && r[m * s.w + j] < rows),
                  "window_stats: window row ", r[m * s.w + j], " of page ", m,
                  " is not a row of q (", rows, " rows)");
  }
  auto f32 = q.options().dtype(at::kFloat);
  std::vector<at::Tensor> out{at::empty({s.M, s.H, s.P}, f32), at::empty({s.M, s.H, s.D}, f32),
                              at::empty({s.M, s.H, s.D}, f32), at::empty({s.M}, f32)};
  std::vector<at::Tensor> prior{attn, q_sum, q_sq_sum, q_count};
  const Form form = page_form(s.D);
  if (q.scalar_type() == at::kFloat)
    run<float>(s, q, lse, k_pages, win_row, win_pos, page_start, n_staged, prior_stage, prior,
               layer, scale, out, form);
  else
    run<c10::BFloat16>(s, q, lse, k_pages, win_row, win_pos, page_start, n_staged, prior_stage,
                       prior, layer, scale, out, form);
  return out;
}

void store_stats(at::Tensor& attn, at::Tensor& q_sum, at::Tensor& q_sq_sum,
                 at::Tensor& q_count, int64_t layer, const at::Tensor& stages,
                 const at::Tensor& acc_attn, const at::Tensor& acc_sum, const at::Tensor& acc_sq,
                 const at::Tensor& acc_count) {
  const char* who = "store_stats";
  check_cpu_tensor(who, attn, "stats.attn", at::kFloat, 4);
  check_cpu_tensor(who, q_sum, "stats.q_sum", at::kFloat, 4);
  check_cpu_tensor(who, q_sq_sum, "stats.q_sq_sum", at::kFloat, 4);
  check_cpu_tensor(who, q_count, "stats.q_count", at::kFloat, 2);
  check_cpu_tensor(who, stages, "stages", at::kLong, 1);
  const int64_t S = attn.size(0), L = attn.size(1), H = attn.size(2), P = attn.size(3);
  const int64_t D = q_sum.size(3), N = stages.size(0);
  TORCH_CHECK(q_sum.sizes() == q_sq_sum.sizes() && q_sum.size(0) == S && q_sum.size(1) == L &&
                  q_sum.size(2) == H && q_count.size(0) == S && q_count.size(1) == L,
              "store_stats: staging statistics ", attn.sizes(), ", ", q_sum.sizes(), ", ",
              q_sq_sum.sizes(), " and ", q_count.sizes(), " are not one storage's [S, L, H, P], "
              "[S, L, H, D] x2 and [S, L]");
  TORCH_CHECK(layer >= 0 && layer < L, "store_stats: layer ", layer, " outside [0, ", L, ")");
  check_cpu_tensor(who, acc_attn, "acc.attn", at::kFloat, 3);
  check_cpu_tensor(who, acc_sum, "acc.q_sum", at::kFloat, 3);
  check_cpu_tensor(who, acc_sq, "acc.q_sq_sum", at::kFloat, 3);
  check_cpu_tensor(who, acc_count, "acc.q_count", at::kFloat, 1);
  TORCH_CHECK(acc_attn.size(0) == N && acc_attn.size(1) == H && acc_attn.size(2) == P &&
                  acc_sum.sizes() == acc_sq.sizes() && acc_sum.size(0) == N &&
                  acc_sum.size(1) == H && acc_sum.size(2) == D && acc_count.size(0) == N,
              "store_stats: accumulators ", acc_attn.sizes(), ", ", acc_sum.sizes(), ", ",
              acc_sq.sizes(), " and ", acc_count.sizes(), " are not [N, H, P], [N, H, D] x2 and "
              "[N] for N = ", N, " stages, H = ", H, ", P = ", P, ", D = ", D);
  const int64_t* st = stages.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(st[i] >= 0 && st[i] < S, "store_stats: stage ", st[i], " is outside [0, ", S,
                ")");
  float *a = attn.data_ptr<float>(), *qs = q_sum.data_ptr<float>();
  float *qq = q_sq_sum.data_ptr<float>(), *qc = q_count.data_ptr<float>();
  for (int64_t i = 0; i < N; ++i) {  // in order: a stage listed twice keeps its last row
    const int64_t at = st[i] * L + layer;
    std::memcpy(a + at * H * P, acc_attn.data_ptr<float>() + i * H * P, H * P * sizeof(float));
    std::memcpy(qs + at * H * D, acc_sum.data_ptr<float>() + i * H * D, H * D * sizeof(float));
    std::memcpy(qq + at * H * D, acc_sq.data_ptr<float>() + i * H * D, H * D * sizeof(float));
    qc[at] = acc_count.data_ptr<float>()[i];
  }
}

std::vector<at::Tensor> gather_pages(const at::Tensor& k_stage, const at::Tensor& v_stage,
                                     const at::Tensor& pages, const at::Tensor& rows) {
  const char* who = "gather_pages";
  TORCH_CHECK(k_stage.device().is_cpu() && v_stage.device().is_cpu() && k_stage.dim() == 4 &&
                  k_stage.is_contiguous() && v_stage.is_contiguous() &&
                  k_stage.sizes() == v_stage.sizes() &&
                  k_stage.scalar_type() == v_stage.scalar_type(),
              "gather_pages: k_stage ", k_stage.sizes(), " and v_stage ", v_stage.sizes(),
              " must be one layer's contiguous CPU staging pages [S, P, H, D] of one dtype");
  check_cpu_tensor(who, pages, "pages", at::kLong, 1);
  check_cpu_tensor(who, rows, "rows", at::kLong, 1);
  const int64_t M = pages.size(0), S = k_stage.size(0), P = k_stage.size(1);
  TORCH_CHECK(rows.size(0) == M, "gather_pages: ", M, " pages but ", rows.size(0), " row counts");
  const int64_t *page = pages.data_ptr<int64_t>(), *n = rows.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(page[m] >= 0 && page[m] < S, "gather_pages: page ", page[m], " is outside [0, ",
                S, ")");
    TORCH_CHECK(n[m] >= 0 && n[m] <= P, "gather_pages: ", n[m], " rows of page ", m,
                " are not in [0, ", P, "]");
  }
  std::vector<int64_t> shape{M, P, k_stage.size(2), k_stage.size(3)};
  std::vector<at::Tensor> out{at::empty(shape, k_stage.options()), at::empty(shape, v_stage.options())};
  const int64_t row_bytes = k_stage.numel() ? k_stage.nbytes() / (S * P) : 0;
  for (int i = 0; i < 2; ++i) {
    const auto* src = static_cast<const char*>((i ? v_stage : k_stage).data_ptr());
    auto* dst = static_cast<char*>(out[i].data_ptr());
    for (int64_t m = 0; m < M; ++m) {
      std::memcpy(dst + m * P * row_bytes, src + page[m] * P * row_bytes, n[m] * row_bytes);
      std::memset(dst + (m * P + n[m]) * row_bytes, 0, (P - n[m]) * row_bytes);
    }
  }
  return out;
}

void copy_rows(at::Tensor& dst, const at::Tensor& slots, const at::Tensor& src,
               const at::Tensor& rows) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu(), "copy_rows: dst and src must "
              "be on the CPU");
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "copy_rows: dst and src must be "
              "contiguous");
  TORCH_CHECK(dst.scalar_type() == src.scalar_type(), "copy_rows: src is ", src.scalar_type(),
              " but dst is ", dst.scalar_type(), " (convert it first)");
  check_cpu_tensor("copy_rows", slots, "slots", at::kLong, 1);
  check_cpu_tensor("copy_rows", rows, "rows", at::kLong, 1);
  TORCH_CHECK(dst.dim() >= 1 && src.dim() == dst.dim() && rows.size(0) == slots.size(0) &&
                  src.sizes().slice(1) == dst.sizes().slice(1),
              "copy_rows: src ", src.sizes(), " must be rows of dst ", dst.sizes(),
              ", rows and slots one entry per copied row (", rows.size(0), " vs ",
              slots.size(0), ")");
  const int64_t n = slots.size(0), dst_rows = dst.size(0), src_rows = src.size(0);
  const int64_t bytes = dst.numel() ? dst.nbytes() / dst_rows : 0;
  const int64_t *slot = slots.data_ptr<int64_t>(), *row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < dst_rows, "copy_rows: slot ", slot[i],
                " is outside [0, ", dst_rows, ")");
    TORCH_CHECK(row[i] < src_rows, "copy_rows: row ", row[i], " is outside src's ", src_rows,
                " rows (negative: zeros)");
  }
  auto* d = static_cast<char*>(dst.data_ptr());
  const auto* s = static_cast<const char*>(src.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    if (row[i] < 0)
      std::memset(d + slot[i] * bytes, 0, bytes);
    else
      std::memcpy(d + slot[i] * bytes, s + row[i] * bytes, bytes);
  }
}

}  // namespace ragged
