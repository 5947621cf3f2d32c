// Sealing's row writer for one layer in one call (seal.h; mem_pool/storage.py `_write_rows`
// under TierRows, bit for bit). The torch writer spends about 50 small ops a group (the
// selection's sorts, index arithmetic, gathers, the quantizer's calls, one index_copy_ per
// tensor): 8.3 ms for a 1-page seal of the mixed default's 30 layers of 3 groups (bench.seal,
// session 30), almost all of it per-op overhead. Here each (page, group, member head) ranks
// its P scores, copies its high-tier tokens and quantizes its tiers in place.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>

#include "checks.h"
#include "pool.h"
#include "quantize.h"
#include "seal.h"

namespace ragged {
namespace {

constexpr const char* kWho = "seal_rows";

// A quantized tier of a group (quant.py's shapes): its tensors' data.
struct Tier {
  int64_t bits = 0, slots = 0, code_bytes = 0;
  bool is_float = false;
  uint8_t* k_codes = nullptr;
  uint8_t* v_codes = nullptr;
  c10::Half* k_scale = nullptr;
  c10::Half* k_zero = nullptr;
  c10::Half* v_scale = nullptr;
  c10::Half* v_zero = nullptr;
};

struct Group {
  int64_t first_head = 0, heads = 0, hi = 0, lo = 0;
  char* rows_k = nullptr;  // [pages, hi, heads, D] at the rows' dtype (a dense high tier)
  char* rows_v = nullptr;
  Tier high, low;  // high.bits 0: the high tier is rows_k / rows_v; low.bits 0: no low tier
};

c10::Half* half_data(const at::Tensor& t) { return reinterpret_cast<c10::Half*>(t.data_ptr<at::Half>()); }

// A group's tier t[0..5] (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero) in a `bits`-bit
// format (0: the group has none), checked by check_tier and against the rows' pages and the
// tier's `slots`.
Tier tier_of(const at::Tensor* t, int64_t bits, bool is_float, int64_t slots, int64_t heads,
             int64_t D, int64_t num_pages, const std::string& at) {
  Tier out;
  if (!bits) return out;
  check_format(kWho, bits, is_float, D);
  const TierExtent got = check_tier(kWho, t, bits, is_float, heads, D, at);
  TORCH_CHECK(got.pages == num_pages && got.slots == slots, kWho, ": ", at, "holds ", got.slots,
              " slots of ", got.pages, " pages, expected ", slots, " of ", num_pages);
  out.bits = bits;
  out.is_float = is_float;
  out.slots = slots;
  out.code_bytes = D * bits / 8;
  out.k_codes = t[0].data_ptr<uint8_t>();
  out.v_codes = t[3].data_ptr<uint8_t>();
  out.k_scale = half_data(t[1]);
  out.v_scale = half_data(t[4]);
  if (!is_float) {
    out.k_zero = half_data(t[2]);
    out.v_zero = half_data(t[5]);
  }
  return out;
}

void to_floats(const char* src, at::ScalarType type, float* out, int64_t D) {
  switch (type) {
    case at::kFloat: std::memcpy(out, src, D * sizeof(float)); break;
    case at::kBFloat16: {
      const auto* s = reinterpret_cast<const c10::BFloat16*>(src);
      for (int64_t c = 0; c < D; ++c) out[c] = static_cast<float>(s[c]);
      break;
    }
    default: {
      const auto* s = reinterpret_cast<const c10::Half*>(src);
      for (int64_t c = 0; c < D; ++c) out[c] = static_cast<float>(s[c]);
    }
  }
}

void from_floats(const float* in, at::ScalarType type, char* dst, int64_t D) {
  switch (type) {
    case at::kFloat: std::memcpy(dst, in, D * sizeof(float)); break;
    case at::kBFloat16: {
      auto* d = reinterpret_cast<c10::BFloat16*>(dst);
      for (int64_t c = 0; c < D; ++c) d[c] = c10::BFloat16(in[c]);  // round to nearest even, as .to()
      break;
    }
    default: {
      auto* d = reinterpret_cast<c10::Half*>(dst);
      for (int64_t c = 0; c < D; ++c) d[c] = c10::Half(in[c]);
    }
  }
}

// a before b in torch.sort(descending=True): NaN above everything (equal keys keep their order:
// the callers break ties by position).
inline bool ranks_before(float a, float b) {
  return std::isnan(a) ? !std::isnan(b) : (!std::isnan(b) && a > b);
}

// One page's work buffers.
struct Scratch {
  std::vector<float> forced, keys, values;  // [P]; [P, D] tier tokens as float32
  std::vector<int64_t> order, hi_tokens, lo_tokens;
  std::vector<const float*> k_rows, v_rows;
  QuantScratch quant;
  Scratch(int64_t P, int64_t D)
      : forced(P), keys(P * D), values(P * D), order(P), hi_tokens(P), lo_tokens(P), k_rows(P),
        v_rows(P) {}
};

// The tokens of one page's head (k, v: token t's D values at k + t * token_stride) quantized
// into slot range [0, n) of `tier` at (page, head hp of `heads`).
void quantize_tier(const Tier& tier, const int64_t* tokens, int64_t n, const char* k, const char* v,
                   int64_t token_stride, at::ScalarType type, int64_t page, int64_t hp,
                   int64_t heads, int64_t D, Scratch& s) {
  for (int64_t j = 0; j < n; ++j) {
    to_floats(k + tokens[j] * token_stride, type, s.keys.data() + j * D, D);
    to_floats(v + tokens[j] * token_stride, type, s.values.data() + j * D, D);
    s.k_rows[j] = s.keys.data() + j * D;
    s.v_rows[j] = s.values.data() + j * D;
  }
  const int64_t cb = tier.code_bytes, codes_at = (page * tier.slots * heads + hp) * cb;
  const int64_t keys_at = (page * heads + hp) * D, values_at = page * tier.slots * heads + hp;
  quantize_tokens(s.k_rows.data(), n, D, tier.bits, tier.is_float, true, tier.k_codes + codes_at,
                  heads * cb, tier.k_scale + keys_at, tier.k_zero ? tier.k_zero + keys_at : nullptr,
                  0, s.quant);
  quantize_tokens(s.v_rows.data(), n, D, tier.bits, tier.is_float, false, tier.v_codes + codes_at,
                  heads * cb, tier.v_scale + values_at,
                  tier.v_zero ? tier.v_zero + values_at : nullptr, heads, s.quant);
}

}  // namespace

void seal_rows(const at::Tensor& k_tok, const at::Tensor& v_tok, const at::Tensor& scores,
               const at::Tensor& sinks, const at::Tensor& pages, const std::vector<int64_t>& heads,
               const std::vector<int64_t>& groups,
               const std::vector<at::Tensor>& tensors) {
  const at::ScalarType src_type = k_tok.scalar_type();
  TORCH_CHECK(src_type == at::kFloat || src_type == at::kBFloat16 || src_type == at::kHalf, kWho,
              ": k_tok must be float32, bfloat16 or float16, got ", src_type);
  check_cpu_tensor(kWho, k_tok, "k_tok", src_type, 4);
  check_cpu_tensor(kWho, v_tok, "v_tok", src_type, 4);
  TORCH_CHECK(v_tok.sizes() == k_tok.sizes(), kWho, ": v_tok ", v_tok.sizes(), " is not k_tok's ",
              k_tok.sizes());
  const int64_t N = k_tok.size(0), P = k_tok.size(1), H = k_tok.size(2), D = k_tok.size(3);
  check_cpu_tensor(kWho, scores, "scores", at::kFloat, 3);
  check_cpu_tensor(kWho, sinks, "sinks", at::kBool, 2);
  check_cpu_tensor(kWho, pages, "pages", at::kLong, 1);
  TORCH_CHECK(scores.size(0) == N && scores.size(1) == H && scores.size(2) == P, kWho, ": scores ",
              scores.sizes(), " is not [", N, ", ", H, ", ", P, "]");
  TORCH_CHECK(sinks.size(0) == N && sinks.size(1) == P, kWho, ": sinks ", sinks.sizes(),
              " is not [", N, ", ", P, "]");
  TORCH_CHECK(pages.size(0) == N, kWho, ": pages has ", pages.size(0), " entries for ", N, " pages");
  TORCH_CHECK(groups.size() % 7 == 0 && tensors.size() == groups.size() / 7 * 14, kWho,
              ": groups must hold 7 integers and tensors 14 entries a group, got ", groups.size(),
              " and ", tensors.size());
  for (int64_t h : heads) TORCH_CHECK(h >= 0 && h < H, kWho, ": KV head ", h, " is not in [0, ", H, ")");

  const int64_t G = static_cast<int64_t>(groups.size()) / 7;
  std::vector<Group> gs(G);
  at::ScalarType row_type = at::kFloat;
  int64_t num_pages = -1, first = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t* info = groups.data() + 7 * g;
    const at::Tensor* t = tensors.data() + 14 * g;
    const std::string at = "group " + std::to_string(g) + " ";
    Group& x = gs[g];
    x.first_head = first;
    x.heads = info[0];
    x.hi = info[1];
    x.lo = info[2];
    first += x.heads;
    TORCH_CHECK(x.heads > 0 && first <= static_cast<int64_t>(heads.size()), kWho, ": ", at,
                "names ", x.heads, " heads past the ", heads.size(), " given");
    TORCH_CHECK(x.hi >= 0 && x.lo >= 0 && x.hi + x.lo <= P, kWho, ": ", at, "keeps ", x.hi, " + ",
                x.lo, " tokens of a ", P, "-token page");
    const at::Tensor& rk = t[0];
    const at::Tensor& rv = t[1];
    if (g == 0) {
      row_type = rk.scalar_type();
      num_pages = rk.size(0);
    }
    check_cpu_tensor(kWho, rk, (at + "rows_k").c_str(), row_type, 4);
    check_cpu_tensor(kWho, rv, (at + "rows_v").c_str(), row_type, 4);
    const int64_t dense = info[3] ? 0 : x.hi;
    TORCH_CHECK(rk.sizes() == rv.sizes() && rk.size(0) == num_pages && rk.size(1) == dense &&
                    rk.size(2) == x.heads && rk.size(3) == D,
                kWho, ": ", at, "rows_k / rows_v are ", rk.sizes(), " / ", rv.sizes(), ", expected [",
                num_pages, ", ", dense, ", ", x.heads, ", ", D, "]");
    x.rows_k = static_cast<char*>(rk.data_ptr());
    x.rows_v = static_cast<char*>(rv.data_ptr());
    x.high = tier_of(t + 2, info[3], info[4] != 0, x.hi, x.heads, D, num_pages, at + "high tier ");
    x.low = tier_of(t + 8, x.lo ? info[5] : 0, info[6] != 0, x.lo, x.heads, D, num_pages,
                    at + "low tier ");
    TORCH_CHECK(!x.lo || x.low.bits, kWho, ": ", at, "keeps ", x.lo, " low-tier tokens but has no low format");
  }
  TORCH_CHECK(first == static_cast<int64_t>(heads.size()), kWho, ": the groups name ", first,
              " heads, heads holds ", heads.size());
  const int64_t* page_of = pages.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(page_of[n] >= -1 && page_of[n] < num_pages, kWho, ": page ", page_of[n],
                " is not in [-1, ", num_pages, ")");

  const char* ks = static_cast<const char*>(k_tok.data_ptr());
  const char* vs = static_cast<const char*>(v_tok.data_ptr());
  const float* sc = scores.data_ptr<float>();
  const bool* sink = sinks.data_ptr<bool>();
  const int64_t src_size = k_tok.element_size(), row_size = at::elementSize(row_type);
  const int64_t token_stride = H * D * src_size;  // bytes between a page's tokens of one head
  pool::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    Scratch s(P, D);
    std::vector<float> row(D);
    for (int64_t n = begin; n < end; ++n) {
      const int64_t page = page_of[n];
      if (page < 0) continue;
      for (const Group& grp : gs)
        for (int64_t hp = 0; hp < grp.heads; ++hp) {
          const int64_t head = heads[grp.first_head + hp];
          // 1. Rank the page's tokens (select_tiers: sinks forced in, stable descending).
          const float* x = sc + (n * H + head) * P;
          for (int64_t t = 0; t < P; ++t)
            s.forced[t] = sink[n * P + t] ? std::numeric_limits<float>::infinity() : x[t];
          std::iota(s.order.begin(), s.order.end(), int64_t(0));
          // A stable sort's order as a total one (ties by position): std::sort allocates no
          // buffer, as stable_sort does on every call.
          std::sort(s.order.begin(), s.order.end(), [&](int64_t a, int64_t b) {
            const float fa = s.forced[a], fb = s.forced[b];
            return ranks_before(fa, fb) || (!ranks_before(fb, fa) && a < b);
          });
          // 2. The hi best, then the next lo, each in position order.
          std::copy(s.order.begin(), s.order.begin() + grp.hi, s.hi_tokens.begin());
          std::copy(s.order.begin() + grp.hi, s.order.begin() + grp.hi + grp.lo, s.lo_tokens.begin());
          std::sort(s.hi_tokens.begin(), s.hi_tokens.begin() + grp.hi);
          std::sort(s.lo_tokens.begin(), s.lo_tokens.begin() + grp.lo);
          const char* k = ks + (n * P * H + head) * D * src_size;  // token t at k + t * token_stride
          const char* v = vs + (n * P * H + head) * D * src_size;
          // 3. The high tier: the tokens as stored at the rows' dtype, or quantized.
          if (grp.high.bits) {
            if (grp.hi)
              quantize_tier(grp.high, s.hi_tokens.data(), grp.hi, k, v, token_stride, src_type, page,
                            hp, grp.heads, D, s);
          } else {
            for (int64_t j = 0; j < grp.hi; ++j) {
              const int64_t at = ((page * grp.hi + j) * grp.heads + hp) * D * row_size;
              const int64_t from = s.hi_tokens[j] * token_stride;
              if (row_type == src_type) {
                std::memcpy(grp.rows_k + at, k + from, D * row_size);
                std::memcpy(grp.rows_v + at, v + from, D * row_size);
              } else {
                to_floats(k + from, src_type, row.data(), D);
                from_floats(row.data(), row_type, grp.rows_k + at, D);
                to_floats(v + from, src_type, row.data(), D);
                from_floats(row.data(), row_type, grp.rows_v + at, D);
              }
            }
          }
          // 4. The low tier, quantized.
          if (grp.lo)
            quantize_tier(grp.low, s.lo_tokens.data(), grp.lo, k, v, token_stride, src_type, page, hp,
                          grp.heads, D, s);
        }
    }
  });
}

}  // namespace ragged
