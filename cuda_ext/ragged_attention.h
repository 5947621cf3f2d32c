// Native CPU ragged attention: one layer, the whole batch, in one call.
//
// Torch-free: this header is included by every ISA variant (isa_*.cpp compile the same kernel
// body, attention_body.inc, for AVX-512 (bfloat16 prefill chunks as AVX512-BF16 products),
// AVX2+FMA and plain x86-64, and for AVX-512 with bfloat16 prefill chunks on AMX tiles:
// isa_amx.cpp, which alone includes torch's cpublas) and by
// bindings.cpp, which checks the tensors, fills `Params` and runs the work items on torch's
// OpenMP pool.
//
// Inputs (all contiguous; T = the storage dtype, float32 or bfloat16; indices int64):
//
//   | name            | shape                          | dtype   | meaning                              |
//   |-----------------|--------------------------------|---------|--------------------------------------|
//   | q               | [N, H_q, D]                    | T       | this forward's queries               |
//   | k_pages/v_pages | [M, P, H, D]                   | T       | every request's tail pages (staged   |
//   |                 |                                |         | tokens + this forward's, zero pad)   |
//   | rows_k/v[g]     | [pages, hi_g, H_p, D]          | T       | group g's full-precision row slots   |
//   | k_codes[g]      | [pages, lo_g, H_p, D * b / 8]  | uint8   | low tier keys (planar packed codes)  |
//   | k_scale/zero[g] | [pages, H_p, D]                | float16 | per channel over a page's lo tokens  |
//   | v_codes[g]      | [pages, lo_g, H_p, D * b / 8]  | uint8   | low tier values                      |
//   | v_scale/zero[g] | [pages, lo_g, H_p]             | float16 | per (token, head)                    |
//   | (high tier)     | the same 6 with hq_g slots     |         | H+L: the hi slots quantized (rows_k/v |
//   |                 |                                |         | then have 0 slots)                   |
//   | formats         | [groups, 4]                    | int64   | low bits, low is_float, high bits,   |
//   |                 |                                |         | high is_float (0 bits: no such tier) |
//   | head_map        | [H, 2]                         | int64   | KV head h -> (group g, slot in g)    |
//   | requests        | [B, 6]                         | int64   | q_start, q_len, prefix, tail_start,  |
//   |                 |                                |         | tail_first (page m), tail_count      |
//   | sealed_off      | [B + 1]                        | int64   | CSR offsets into sealed_pages        |
//   | sealed_pages    | [S]                            | int64   | logical pages of each request's rows |
//
// Request b's queries are rows [q_start, q_start + q_len) at positions prefix + i; its keys are
// every slot of its sealed pages (hi slots, dense or quantized, then lo slots; all visible) followed by its tail
// tokens at positions tail_start + t, t < prefix + q_len - tail_start, visible to a query at
// position x iff tail_start + t <= x. Tokens past the end are never read.
//
// Work: an item is (request b, KV head h, query block of up to q_block positions, a range of key
// units); a unit is one sealed page or one tail page. Each item runs an online softmax over its
// units for all G = H_q / H query heads of h at once (every key and code read once per block)
// and writes its partial output normalized, with its log-sum-exp; bindings.cpp merges the
// splits of a block (out = sum_s exp(lse_s - lse) out_s, lse = logsumexp_s lse_s).
// Blocks hold 32 / G query positions, or on the avx512 and amx variants, when a bfloat16
// forward has a prefill chunk, up to kTileRows / G (the longest chunk in equal blocks: its
// pages' dequantized, packed tiles serve more rows).
#pragma once

#include <cstdint>

namespace ragged {

// Format of a quantized tier (quant.py): bits 8/4/2 asymmetric integer codes with scale and
// zero point, or fp8 e4m3 (bits 8, is_float) with a scale only.
struct LowFormat {
  int bits = 0;  // 0: no such tier in this group
  bool is_float = false;
};

// One quantized tier of a group's rows (the low tier, or with H+L the quantized hi slots).
struct QuantRows {
  int64_t slots = 0;                  // tokens per page (0: none)
  LowFormat fmt;
  const uint8_t* k_codes = nullptr;   // [pages, slots, H_p, D * b / 8]
  const uint16_t* k_scale = nullptr;  // float16 bits [pages, H_p, D]
  const uint16_t* k_zero = nullptr;   // (integer formats)
  const uint8_t* v_codes = nullptr;
  const uint16_t* v_scale = nullptr;  // float16 bits [pages, slots, H_p]
  const uint16_t* v_zero = nullptr;
};

struct GroupRows {
  int64_t hi = 0, heads = 0;      // dense slots per page (at T); H_p
  const void* rows_k = nullptr;   // [pages, hi, H_p, D] T
  const void* rows_v = nullptr;
  QuantRows high, low;            // each group its own formats
};

struct Request {
  int64_t q_start, q_len, prefix, tail_start, tail_first, tail_count;
};

struct Params {
  int64_t heads_q, heads_kv, group_size, head_dim, page_size;  // H_q, H, G, D, P
  int64_t q_block;     // query positions per item (rows per item: q_block * G)
  float scale;         // softmax scale (folded into the queries)
  const void* q;       // [N, H_q, D] T
  const void* k_pages; // [M, P, H, D] T
  const void* v_pages;
  const GroupRows* groups;      // [num groups]
  const int64_t* head_map;      // [H, 2]
  const Request* requests;      // [B]
  const int64_t* sealed_off;    // [B + 1]
  const int64_t* sealed_pages;  // [S]
};

struct Item {
  int64_t b, h, q0;      // request, KV head, first query index of the block (within b)
  int64_t u0, u1;        // key units [u0, u1): sealed pages first, then tail pages
  int64_t out;           // index of the item's partial output (rows of o_part / lse_part)
};

// Rows per item of a forward with bfloat16 prefill chunks on avx512 or amx (at most 256:
// run_item's per-row limits).
constexpr int64_t kTileRows = 256;

// Rows per item of a forward with prefill chunks on avx2 (key columns, attention_body.inc):
// a unit's transposed keys and converted values serve every row of a block.
constexpr int64_t kColumnBlockRows = 96;

// Keys per unit of the bfloat16 products' sealed pages (several pages' hi slots, or several pages'
// dequantized tiers: fewer softmax passes per row), at least a padded page (a tail page).
constexpr int64_t kTileKeys = 256;
inline int64_t unit_keys(const Params& p) {
  const int64_t Pp = (p.page_size + 15) / 16 * 16;
  return Pp > kTileKeys ? Pp : kTileKeys;
}

// Keys are attended in tiles of kKeyTile (one 16-float vector per query row and channel).
constexpr int64_t kKeyTile = 16;

inline int64_t padded_page(const Params& p) {
  return (p.page_size + kKeyTile - 1) / kKeyTile * kKeyTile;
}

// Floats of the extend path's bfloat16 operands (RAGGED_TILES; 64-byte aligned starts): logits
// [R, U] float32 (U = unit_keys), then bfloat16 (2 per float): queries [R, 2D], probabilities
// [R, U], a unit's keys as rows and packed for the tiles [U, 2D] each (2D: a dequantized key's
// bfloat16 high and low parts), its values as rows and packed [U, D] each.
inline int64_t tile_workspace_floats(const Params& p) {
  const int64_t R = p.q_block * p.group_size, D = p.head_dim, U = unit_keys(p);
  return R * U + (2 * R * D + R * U + 6 * U * D) / 2 + 7 * 16 + 16;
}

// Floats of the integer-tier scratch (bfloat16 storages, attention_body.inc's VNNI and AVX2
// sections; 64-byte aligned starts): row scales [R] float32, then bytes: queries' two int8
// parts [R, 2, D] (AVX2: int16 [R, D]), a page's value codes in 4-token groups [Pp, D] (AVX2:
// int16 in token pairs, [Pp, D] of 2 bytes), one row's probability parts [2, Pp] (AVX2: [Pp]
// int16).
inline int64_t vnni_workspace_floats(const Params& p) {
  const int64_t R = p.q_block * p.group_size, D = p.head_dim, Pp = padded_page(p);
  return R + (2 * R * D + 2 * Pp * D + 2 * Pp) / 4 + 4 * 16 + 16;
}

// Floats of per-thread workspace one item needs (scaled queries, logits, a unit's keys
// transposed (AVX2's key columns: kKeyTile spare floats a channel) and values converted,
// per-page parameters, softmax state, AVX-512 partial dots, the bfloat16 queries as stored
// [R, D], a unit's value segments [Pp] of 4 x 8 bytes).
inline int64_t workspace_floats(const Params& p) {
  const int64_t R = p.q_block * p.group_size, D = p.head_dim, Pp = padded_page(p);
  return 2 * R * D + R * Pp + (2 * Pp + kKeyTile) * D + 2 * (D > Pp ? D : Pp) + 4 * R +
         R * kKeyTile * kKeyTile + D + vnni_workspace_floats(p) + (R * D / 2 + 16) +
         (8 * Pp + 16) + tile_workspace_floats(p);
}

// Runs items [begin, end): partial outputs o_part [., R, D] (normalized) and lse_part [., R]
// (-inf where a row saw no key of the item), rows r = i * G + j (query i of the block, query
// head h * G + j). `bf16`: T is bfloat16, else float32.
using RunItems = void (*)(const Params&, const Item*, int64_t begin, int64_t end, float* ws,
                          float* o_part, float* lse_part, bool bf16);

namespace avx512 { void run_items(const Params&, const Item*, int64_t, int64_t, float*, float*, float*, bool); }
namespace avx2 { void run_items(const Params&, const Item*, int64_t, int64_t, float*, float*, float*, bool); }
namespace amx {
void run_items(const Params&, const Item*, int64_t, int64_t, float*, float*, float*, bool);
bool usable();  // cpublas multiplies bfloat16 on AMX here (oneDNN ukernels)
}
namespace scalar { void run_items(const Params&, const Item*, int64_t, int64_t, float*, float*, float*, bool); }

}  // namespace ragged
