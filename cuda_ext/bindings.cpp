// Torch binding of the native ragged attention (ragged_attention.h: inputs and work split).
//
// attend(...) checks every tensor (dtype, shape, contiguity) with a message naming it, builds
// the work items, runs them on the kernels' pool (pool.h; at::parallel_for under
// RAGGED_NATIVE_POOL=openmp) with the ISA variant
// chosen once (best the CPU supports, or lower via RAGGED_NATIVE_ISA=amx|avx512|avx2|scalar;
// avx512 runs bfloat16 prefill chunks as AVX512-BF16 products, amx on AMX tiles), and
// merges each query block's key splits by log-sum-exp into out [N, H_q, D] (q's dtype) and
// lse [N, H_q] float32. Rows of q no request owns are left as allocated. A forward of fewer
// than serial_pairs (query row, key) pairs runs on the calling thread, unsplit.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "checks.h"
#include "elementwise.h"
#include "linear.h"
#include "pool.h"
#include "quantize.h"
#include "ragged_attention.h"
#include "seal.h"
#include "tails.h"

namespace ragged {
namespace {

struct Isa {
  std::string name;
  RunItems run;
  bool tiles = false;  // bfloat16 prefill chunks as matrix products (RAGGED_TILES)
  // Rows per item of forwards with prefill chunks, any dtype (0: 32, as decode; the tiles take
  // kTileRows of bfloat16 chunks): avx2 multiplies blocks of many rows on key columns, whose
  // transpose and value conversion a unit's rows share.
  int64_t extend_rows = 0;
};

// The best ISA variant this CPU runs, or the one RAGGED_NATIVE_ISA names (never above the
// best: forcing avx512 on an AVX2 machine is refused).
Isa pick_isa() {
  __builtin_cpu_init();
  std::vector<Isa> usable;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni")) {
    if (amx::usable()) usable.push_back({"amx", &amx::run_items, true});  // products on AMX
    usable.push_back({"avx512", &avx512::run_items, true});  // products on vdpbf16ps
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    usable.push_back({"avx2", &avx2::run_items, false, kColumnBlockRows});
  usable.push_back({"scalar", &scalar::run_items});
  const char* want = std::getenv("RAGGED_NATIVE_ISA");
  if (!want || !*want) return usable.front();
  for (const Isa& isa : usable)
    if (isa.name == want) return isa;
  std::string names;
  for (const Isa& isa : usable) names += " " + isa.name;
  TORCH_CHECK(false, "RAGGED_NATIVE_ISA=", want, " is not one this CPU runs; choose one of:",
              names, " (or unset it)");
}

const Isa& isa() {
  static const Isa chosen = pick_isa();
  return chosen;
}

void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim) {
  check_cpu_tensor("native attention", t, name, dtype, dim);
}

const uint16_t* half_ptr(const at::Tensor& t) {
  return t.numel() ? reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()) : nullptr;
}

// One quantized tier of group g (t[0..5]: k_codes, k_scale, k_zero, v_codes, v_scale, v_zero;
// undefined or empty when the group has no such tier) in format `fmt` (bits 0: none).
QuantRows quant_rows(const at::Tensor* t, LowFormat fmt, int64_t heads, int64_t head_dim,
                     const std::string& at) {
  QuantRows out;
  out.fmt = fmt;
  if (!t[0].defined() || t[0].numel() == 0) return out;
  TORCH_CHECK(fmt.bits, "native attention: ", at, "has codes but its format says 0 bits");
  out.slots = check_tier("native attention", t, fmt.bits, fmt.is_float, heads, head_dim, at).slots;
  out.k_codes = t[0].data_ptr<uint8_t>();
  out.v_codes = t[3].data_ptr<uint8_t>();
  out.k_scale = half_ptr(t[1]);
  out.v_scale = half_ptr(t[4]);
  if (!fmt.is_float) {
    out.k_zero = half_ptr(t[2]);
    out.v_zero = half_ptr(t[5]);
  }
  return out;
}

// A format row of `formats` (bits, is_float) checked.
LowFormat tier_format(int64_t bits, int64_t is_float, const std::string& what) {
  TORCH_CHECK(bits == 0 || bits == 2 || bits == 4 || bits == 8, "native attention: ", what,
              " bits must be 0, 2, 4 or 8, got ", bits);
  TORCH_CHECK(!is_float || bits == 8, "native attention: ", what, " fp8 codes are 8 bits, got ",
              bits);
  return LowFormat{int(bits), is_float != 0};
}

// Group g's rows: rows_k/v [pages, hi, H_p, D], its quantized high tier high[0..5] and low tier
// low[0..5] (quant_rows), in the formats of row g of formats [groups, 4].
GroupRows group_rows(const at::Tensor& rk, const at::Tensor& rv, const at::Tensor* high,
                     const at::Tensor* low, const int64_t* fmt, const Params& p,
                     at::ScalarType dtype, int64_t g) {
  const std::string at = "group " + std::to_string(g) + " ";
  check_tensor(rk, (at + "rows_k").c_str(), dtype, 4);
  check_tensor(rv, (at + "rows_v").c_str(), dtype, 4);
  TORCH_CHECK(rk.sizes() == rv.sizes() && rk.size(3) == p.head_dim,
              "native attention: ", at, "rows_k/rows_v shapes ", rk.sizes(), " / ", rv.sizes(),
              " do not match each other or head_dim ", p.head_dim);
  GroupRows out;
  out.hi = rk.size(1);
  out.heads = rk.size(2);
  out.rows_k = rk.data_ptr();
  out.rows_v = rv.data_ptr();
  out.low = quant_rows(low, tier_format(fmt[0], fmt[1], at + "low tier"), out.heads,
                       p.head_dim, at + "low tier ");
  out.high = quant_rows(high, tier_format(fmt[2], fmt[3], at + "high tier"), out.heads,
                        p.head_dim, at + "high tier ");
  return out;
}

// Splits of each query block's key units: enough items for every thread (2 per thread)
// when the batch alone has fewer blocks, never more splits than units.
int64_t splits_per_block(int64_t blocks, int64_t threads) {
  const int64_t want = 2 * threads;
  return blocks >= want ? 1 : (want + blocks - 1) / blocks;
}

template <class T>
void merge(const Params& p, const std::vector<Item>& items, const std::vector<int64_t>& block_first,
           const float* o_part, const float* lse_part, T* out, float* lse_out, bool serial) {
  const int64_t G = p.group_size, D = p.head_dim, R_max = p.q_block * G;
  const int64_t n_blocks = int64_t(block_first.size()) - 1;
  const int64_t grain = serial ? std::max<int64_t>(n_blocks, 1) : 1;
  pool::parallel_for(0, n_blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t blk = begin; blk < end; ++blk) {
      const Item& it0 = items[block_first[blk]];
      const Request& rq = p.requests[it0.b];
      const int64_t nq = std::min(p.q_block, rq.q_len - it0.q0);
      for (int64_t r = 0; r < nq * G; ++r) {
        float mx = -INFINITY;
        for (int64_t s = block_first[blk]; s < block_first[blk + 1]; ++s)
          mx = std::max(mx, lse_part[items[s].out * R_max + r]);
        float sum = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t s = block_first[blk]; s < block_first[blk + 1]; ++s) {
          const float l = lse_part[items[s].out * R_max + r];
          if (l == -INFINITY) continue;
          const float w = std::exp(l - mx);
          sum += w;
          const float* o = o_part + (items[s].out * R_max + r) * D;
          for (int64_t c = 0; c < D; ++c) acc[c] += w * o[c];
        }
        const int64_t row = rq.q_start + it0.q0 + r / G, head = it0.h * G + r % G;
        T* dst = out + (row * p.heads_q + head) * D;
        for (int64_t c = 0; c < D; ++c) dst[c] = static_cast<T>(acc[c] / sum);
        lse_out[row * p.heads_q + head] = mx + std::log(sum);
      }
    }
  });
}

}  // namespace

std::string isa_name() { return isa().name; }

std::vector<at::Tensor> attend(const at::Tensor& q, const at::Tensor& k_pages,
                               const at::Tensor& v_pages, const std::vector<at::Tensor>& rows_k,
                               const std::vector<at::Tensor>& rows_v,
                               const std::vector<at::Tensor>& low,
                               const std::vector<at::Tensor>& high, const at::Tensor& formats,
                               const at::Tensor& head_map, const at::Tensor& requests,
                               const at::Tensor& sealed_off, const at::Tensor& sealed_pages,
                               double scale, int64_t serial_pairs) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "native attention runs float32 and bfloat16 caches, not ", dtype,
              "; use --ragged-attention batched for other dtypes");
  check_tensor(q, "q", dtype, 3);
  check_tensor(k_pages, "k_pages", dtype, 4);
  check_tensor(v_pages, "v_pages", dtype, 4);
  check_tensor(head_map, "head_map", at::kLong, 2);
  check_tensor(formats, "formats", at::kLong, 2);
  check_tensor(requests, "requests", at::kLong, 2);
  check_tensor(sealed_off, "sealed_off", at::kLong, 1);
  check_tensor(sealed_pages, "sealed_pages", at::kLong, 1);
  TORCH_CHECK(k_pages.sizes() == v_pages.sizes(), "native attention: k_pages ", k_pages.sizes(),
              " and v_pages ", v_pages.sizes(), " differ");
  Params p{};
  p.heads_q = q.size(1);
  p.head_dim = q.size(2);
  p.heads_kv = head_map.size(0);
  p.page_size = k_pages.size(1);
  TORCH_CHECK(p.head_dim % 16 == 0 && p.head_dim <= 512,
              "native attention needs head_dim a multiple of 16 up to 512, got ", p.head_dim);
  TORCH_CHECK(p.heads_kv > 0 && p.heads_q % p.heads_kv == 0, "native attention: ", p.heads_q,
              " query heads are not a multiple of ", p.heads_kv, " KV heads");
  TORCH_CHECK(k_pages.size(2) == p.heads_kv && k_pages.size(3) == p.head_dim,
              "native attention: k_pages ", k_pages.sizes(), " is not [M, P, ", p.heads_kv, ", ",
              p.head_dim, "]");
  p.group_size = p.heads_q / p.heads_kv;
  TORCH_CHECK(p.group_size <= 256, "native attention: more than 256 query heads per KV head");
  p.q_block = std::max<int64_t>(1, 32 / p.group_size);
  p.scale = float(scale);
  const int64_t G_rows = int64_t(rows_k.size());
  TORCH_CHECK(int64_t(rows_v.size()) == G_rows && int64_t(low.size()) == 6 * G_rows &&
                  int64_t(high.size()) == 6 * G_rows,
              "native attention: ", G_rows, " groups need as many rows_v and 6 low and 6 high "
              "tensors each (empty where a group has no such tier), got ", rows_v.size(), ", ",
              low.size(), " and ", high.size());
  TORCH_CHECK(formats.size(0) == G_rows && formats.size(1) == 4, "native attention: formats ",
              formats.sizes(), " is not [", G_rows, ", 4] (low bits, low is_float, high bits, "
              "high is_float per group)");
  std::vector<GroupRows> groups;
  for (int64_t g = 0; g < G_rows; ++g)
    groups.push_back(group_rows(rows_k[g], rows_v[g], &high[6 * g], &low[6 * g],
                                formats.data_ptr<int64_t>() + 4 * g, p, dtype, g));
  const int64_t B = requests.size(0);
  TORCH_CHECK(requests.size(1) == 6 && sealed_off.size(0) == B + 1,
              "native attention: requests must be [B, 6] and sealed_off [B + 1]");
  const int64_t* hm = head_map.data_ptr<int64_t>();
  for (int64_t h = 0; h < p.heads_kv; ++h)
    TORCH_CHECK(hm[2 * h] >= 0 && hm[2 * h] < G_rows &&
                    hm[2 * h + 1] < groups[hm[2 * h]].heads,
                "native attention: head_map row ", h, " points outside the groups");
  p.q = q.data_ptr();
  p.k_pages = k_pages.data_ptr();
  p.v_pages = v_pages.data_ptr();
  p.groups = groups.data();
  p.head_map = hm;
  p.requests = reinterpret_cast<const Request*>(requests.data_ptr<int64_t>());
  p.sealed_off = sealed_off.data_ptr<int64_t>();
  p.sealed_pages = sealed_pages.data_ptr<int64_t>();
  // avx512 and amx run bfloat16 prefill chunks in blocks of up to kTileRows rows (a page's
  // dequantized, packed keys and values serve every row of a block), avx2 any prefill chunk in
  // blocks of up to kColumnBlockRows (key columns), the longest chunk cut into equal blocks.
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, p.requests[b].q_len);
  const int64_t extend_rows = dtype == at::kBFloat16 && isa().tiles ? kTileRows : isa().extend_rows;
  if (longest > 1 && extend_rows) {
    const int64_t most = std::max<int64_t>(1, extend_rows / p.group_size);
    const int64_t blocks = (longest + most - 1) / most;
    p.q_block = (longest + blocks - 1) / blocks;
  }

  // Work items: (request, KV head, query block) blocks, each split over its key units.
  int64_t n_blocks = 0;
  for (int64_t b = 0; b < B; ++b)
    n_blocks += p.heads_kv * ((p.requests[b].q_len + p.q_block - 1) / p.q_block);
  int64_t pairs = 0;  // (query row, key) pairs, at most (whole tail pages)
  for (int64_t b = 0; b < B; ++b) {
    const Request& rq = p.requests[b];
    int64_t keys = rq.tail_count * p.page_size;
    for (int64_t i = p.sealed_off[b]; i < p.sealed_off[b + 1]; ++i) keys += p.page_size;
    pairs += rq.q_len * p.heads_q * keys;
  }
  // A small layer runs on the calling thread: waking the pool costs more than it gives.
  const bool serial = pairs < serial_pairs;
  const int64_t threads = serial ? 1 : at::get_num_threads();
  const int64_t splits = splits_per_block(n_blocks, threads);
  std::vector<Item> items;
  std::vector<int64_t> block_first{0};
  for (int64_t b = 0; b < B; ++b) {
    const Request& rq = p.requests[b];
    const int64_t units = p.sealed_off[b + 1] - p.sealed_off[b] + rq.tail_count;
    const int64_t n_split = std::max<int64_t>(1, std::min(splits, units));
    for (int64_t h = 0; h < p.heads_kv; ++h)
      for (int64_t q0 = 0; q0 < rq.q_len; q0 += p.q_block) {
        for (int64_t s = 0; s < n_split; ++s) {
          const int64_t out = int64_t(items.size());
          items.push_back({b, h, q0, units * s / n_split, units * (s + 1) / n_split, out});
        }
        block_first.push_back(int64_t(items.size()));
      }
  }
  const int64_t R_max = p.q_block * p.group_size, n_items = int64_t(items.size());
  auto fopt = q.options().dtype(at::kFloat);
  at::Tensor o_part = at::empty({std::max<int64_t>(n_items, 1), R_max, p.head_dim}, fopt);
  at::Tensor lse_part = at::empty({std::max<int64_t>(n_items, 1), R_max}, fopt);
  at::Tensor ws = at::empty({threads, workspace_floats(p)}, fopt);
  const RunItems run = isa().run;
  const bool bf16 = dtype == at::kBFloat16;
  float* ws_ptr = ws.data_ptr<float>();
  float* o_ptr = o_part.data_ptr<float>();
  float* l_ptr = lse_part.data_ptr<float>();
  const int64_t grain = serial ? std::max<int64_t>(n_items, 1) : 1;
  pool::parallel_for(0, n_items, grain, [&](int64_t begin, int64_t end) {
    float* mine = ws_ptr + (serial ? 0 : pool::thread_num()) * workspace_floats(p);
    run(p, items.data(), begin, end, mine, o_ptr, l_ptr, bf16);
  });

  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, fopt);
  if (bf16)
    merge(p, items, block_first, o_ptr, l_ptr, out.data_ptr<at::BFloat16>(), lse.data_ptr<float>(),
          serial);
  else
    merge(p, items, block_first, o_ptr, l_ptr, out.data_ptr<float>(), lse.data_ptr<float>(), serial);
  return {out, lse};
}

// A piece's work in the probes below: `us` microseconds of spinning.
void busy_for(int64_t us) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  while (std::chrono::steady_clock::now() < until) {
  }
}

// Probes of pool.cpp for tests/unit/test_native_pool.py: [n, 3] int64 rows (times index i ran,
// the pool thread that ran it, runs of a nested parallel_for of `nested` indices inside it), each
// piece busy for piece_us first; the GIL is released, so Python threads can run them at once.
at::Tensor pool_trace(int64_t n, int64_t grain, int64_t piece_us, int64_t nested) {
  TORCH_CHECK(n >= 0 && grain >= 1 && piece_us >= 0 && nested >= 0,
              "pool_trace: n, piece_us and nested must be at least 0 and grain at least 1");
  at::Tensor out = at::zeros({n, 3}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  pybind11::gil_scoped_release nogil;
  pool::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    busy_for(piece_us);
    for (int64_t i = b; i < e; ++i) {
      __atomic_fetch_add(&o[3 * i], 1, __ATOMIC_RELAXED);
      o[3 * i + 1] = pool::thread_num();
      pool::parallel_for(0, nested, 1, [&](int64_t nb, int64_t ne) {
        __atomic_fetch_add(&o[3 * i + 2], ne - nb, __ATOMIC_RELAXED);
      });
    }
  });
  return out;
}

// A parallel_for over [0, n) whose index `fail` raises (after piece_us of work in every piece).
void pool_fail(int64_t n, int64_t fail, int64_t piece_us) {
  pybind11::gil_scoped_release nogil;
  pool::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    busy_for(piece_us);
    TORCH_CHECK(fail < b || fail >= e, "pool_fail: index ", fail, " failed as asked");
  });
}

}  // namespace ragged

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Native CPU ragged attention (cuda_ext/ragged_attention.h)";
  m.def("attend", &ragged::attend, "One layer's ragged attention for the whole batch");
  m.def("window_stats", &ragged::window_stats,
        "Window statistics of the batch's tail pages, prior accumulators added (tails.cpp)");
  m.def("gather_pages", &ragged::gather_pages,
        "[k_stage[pages[m], :rows[m]] then zeros] for k and v: a decode step's tail pages (tails.cpp)");
  m.def("store_stats", &ragged::store_stats,
        "stats.*[stages[i], layer] = acc.*[i]: StagingStats.store in one call (tails.cpp)");
  m.def("copy_rows", &ragged::copy_rows, "dst[slots[i]] = src[rows[i]] (zeros where rows[i] < 0), any dtype (tails.cpp)");
  m.def("pool_kind", [] { return std::string(ragged::pool::kind()); },
        "Which pool splits the kernels' work: 'pool' (pool.cpp) or 'openmp' (RAGGED_NATIVE_POOL)");
  m.def("pool_threads", &ragged::pool::threads, "How many threads the pool's next run may use");
  m.def("pool_trace", &ragged::pool_trace, pybind11::arg("n"), pybind11::arg("grain"),
        pybind11::arg("piece_us"), pybind11::arg("nested"), "A probe of the pool (tests)");
  m.def("pool_fail", &ragged::pool_fail, pybind11::arg("n"), pybind11::arg("fail"),
        pybind11::arg("piece_us"), "A probe of the pool whose index `fail` raises (tests)");
  m.def("isa", &ragged::isa_name, "The ISA variant in use (RAGGED_NATIVE_ISA forces a lower one)");
  m.def("quantize_low", &ragged::quantize_low,
        "Pages' low-tier codes and parameters (mem_pool/quant.py _quantize, bit for bit)");
  m.def("seal_rows", &ragged::seal_rows,
        "One layer's sealed rows as the torch row writer writes them, in one call (seal.cpp)");
  m.def("linear_bf16", &ragged::linear_bf16, pybind11::arg("x"), pybind11::arg("weight"),
        pybind11::arg("bias") = pybind11::none(),
        "bf16(x @ weight^T + bias) in float32 sums, the weight read as bfloat16 (linear.cpp)");
  m.def("linear_isa", &ragged::linear_isa,
        "The form linear_bf16 runs here: avx512_bf16 (below linear_dot_rows rows), avx2 or scalar");
  m.def("linear_dot_rows", &ragged::linear_dot_rows,
        "Below how many rows linear_bf16 runs vdpbf16ps dots here (0: it does not)");
  m.def("set_linear_dot_serial_macs", &ragged::set_linear_dot_serial_macs, pybind11::arg("macs"),
        "linear_bf16's dots run calls below this many products on one thread (compat/cpu_gemm)");
  m.def("linear_dot_serial_macs", &ragged::linear_dot_serial_macs,
        "Below how many products linear_bf16's dots stay on the calling thread");
  m.def("rms_norm", &ragged::rms_norm, pybind11::arg("x"), pybind11::arg("residual"),
        pybind11::arg("weight"), pybind11::arg("eps"),
        "SGLang's RMSNorm.forward_native in one pass: [out] or [out, x + residual] (elementwise.cpp)");
  m.def("rotary_embedding", &ragged::rotary_embedding, pybind11::arg("positions"),
        pybind11::arg("query"), pybind11::arg("key"), pybind11::arg("cos_sin_cache"),
        pybind11::arg("head_size"), pybind11::arg("neox"),
        "SGLang's RotaryEmbedding.forward_native in one pass, bit for bit: [query, key] (elementwise.cpp)");
  m.def("hadamard_heads", &ragged::hadamard_heads, pybind11::arg("x"), pybind11::arg("signs"),
        pybind11::arg("inverse"),
        "x [T, heads, D] times each KV head's randomized Hadamard matrix (R^T: inverse), as "
        "rotation.py's fwht (elementwise.cpp)");
}
