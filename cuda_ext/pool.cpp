// The native kernels' own thread pool: pieces of a range that the caller takes itself, and a
// worker only where it is awake to take them.
//
// Why not at::parallel_for (OpenMP): a served decode step on a CPU is some 150 parallel regions
// (a dense product per layer and projection, an attention call per layer), each 10-100 us of
// work, with Python between them. libgomp's idle worker spins GOMP_SPINCOUNT iterations and then
// sleeps; a region's caller wakes it and then waits at the region's end for it to arrive, however
// late. On a 2-core VM that wake-up cost more than the second core gave: at 1 request, 74% of a
// SmolLM2 step sat in the dense products, 2.3x their back-to-back time (docs/results.md, "The
// native kernels' own pool"). A longer spin served x1.2-1.4 alone and x0.35 beside another busy
// process on the same cores.
//
// Here a run publishes its pieces in one word (generation, count, next); the caller and any
// awake worker claim pieces with a compare-and-swap on it, and the caller waits only until every
// claimed piece is done: a worker that wakes after the caller took the last piece finds nothing
// and the caller never waited for it. So a run costs at most about its work on one thread, and
// the second core helps wherever its worker is awake. Workers spin RAGGED_POOL_SPIN_US (default
// SPIN_US) after their last piece, then sleep on a futex; the caller wakes them only where one
// sleeps.
//
// Correctness of the hand-off: a claim of piece i of generation g succeeds only while g's pieces
// are not all claimed, and the caller rewrites the job only after all of g's pieces are done, so
// a worker reads the job after its successful claim (which acquires the caller's release of the
// word) and the job cannot change under it. The sleep is Dekker-style: a worker counts itself a
// sleeper, then reads the word; the caller stores the word, then reads the sleeper count (both
// sequentially consistent), so one of them sees the other's store, and the futex word's sequence
// number, read before the re-check, turns a wake-up that comes between into an immediate return.
//
// The pool grows to torch's intra-op thread count at a run's start; where the caller is bound to
// fewer CPUs than that, worker k takes OpenMP thread k's affinity (SGLang binds them to cores
// under SGLANG_CPU_OMP_THREADS_BIND); a forked child starts a fresh pool (its parent's workers
// do not exist there). A run from inside a piece, inside an OpenMP region, or while another thread's run
// holds the pool runs on its caller.
#include "pool.h"

#include <ATen/Parallel.h>
#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define RAGGED_PAUSE() _mm_pause()
#else
#define RAGGED_PAUSE() ((void)0)
#endif

namespace ragged::pool {
namespace {

constexpr int64_t SPIN_US = 100;         // a worker's spin after its last piece (RAGGED_POOL_SPIN_US)
constexpr int64_t PIECES_PER_THREAD = 4;  // pieces a run is cut into, per thread (a late worker's share)
constexpr int64_t YIELD_AFTER_US = 50;    // the caller's wait for claimed pieces yields after this

// The published word: generation (24 bits) | piece count (20) | next unclaimed piece (20).
constexpr int NEXT_BITS = 20, COUNT_BITS = 20;
constexpr uint64_t FIELD = (uint64_t(1) << NEXT_BITS) - 1;
constexpr int64_t MAX_PIECES = int64_t(FIELD);
inline uint64_t next_of(uint64_t w) { return w & FIELD; }
inline uint64_t count_of(uint64_t w) { return (w >> NEXT_BITS) & FIELD; }
inline uint64_t gen_of(uint64_t w) { return w >> (NEXT_BITS + COUNT_BITS); }
inline uint64_t pack(uint64_t gen, uint64_t count) {
  return (gen & ((uint64_t(1) << 24) - 1)) << (NEXT_BITS + COUNT_BITS) | count << NEXT_BITS;
}

thread_local int tls_thread = 0;         // thread_num(): 0 outside the workers
thread_local bool tls_in_piece = false;  // a run from inside a piece runs on its caller

using Clock = std::chrono::steady_clock;

long futex(std::atomic<uint32_t>* addr, int op, uint32_t value) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, value, nullptr, nullptr, 0);
}

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  return (end && *end == '\0' && x >= 0) ? int64_t(x) : fallback;
}

struct State {
  // The job of the current generation; rewritten only when all its pieces are done.
  std::atomic<Body> body{nullptr};
  std::atomic<const void*> ctx{nullptr};
  std::atomic<int64_t> begin{0}, end{0}, piece{1};
  std::atomic<uint64_t> word{0};
  std::atomic<int> active{1};  // the current run's threads: workers from this index on stay out
  std::atomic<int64_t> done{0};
  std::exception_ptr error;   // the first piece's exception, rethrown on the caller
  std::mutex error_set;
  std::atomic<uint32_t> wake_seq{0};
  std::atomic<int> sleepers{0};
  std::mutex caller;         // one run at a time; others run on their callers
  int workers = 0;           // started so far (worker k has tls_thread k + 1)
  const int64_t spin_us = env_int("RAGGED_POOL_SPIN_US", SPIN_US);

  // Claim the next piece of the current generation: true with its index in `i`. A worker
  // beyond the run's thread count (torch's count lowered since it started) claims nothing: its
  // thread_num() would index past a workspace sized for the run.
  bool claim(int64_t& i) {
    uint64_t w = word.load(std::memory_order_acquire);
    while (next_of(w) < count_of(w) && tls_thread < active.load(std::memory_order_relaxed)) {
      if (word.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel,
                                     std::memory_order_acquire)) {
        i = int64_t(next_of(w));
        return true;
      }
    }
    return false;
  }

  // Run piece i of the current job, and count it done.
  void run_piece(int64_t i) {
    const int64_t p = piece.load(std::memory_order_relaxed);
    const int64_t b = begin.load(std::memory_order_relaxed) + i * p;
    const int64_t e = std::min(b + p, end.load(std::memory_order_relaxed));
    tls_in_piece = true;
    try {
      body.load(std::memory_order_relaxed)(ctx.load(std::memory_order_relaxed), b, e);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_set);
      if (!error) error = std::current_exception();
    }
    tls_in_piece = false;
    done.fetch_add(1, std::memory_order_release);
  }

  void worker_loop() {
    for (;;) {
      int64_t i;
      while (claim(i)) run_piece(i);
      // Nothing to claim: spin until the word moves or the spin is over, then sleep.
      const uint64_t w = word.load(std::memory_order_acquire);
      const auto deadline = Clock::now() + std::chrono::microseconds(spin_us);
      bool moved = false;
      while (!moved && Clock::now() < deadline) {
        for (int k = 0; k < 32 && !moved; ++k) {
          RAGGED_PAUSE();
          moved = word.load(std::memory_order_relaxed) != w;
        }
      }
      if (moved) continue;
      sleepers.fetch_add(1, std::memory_order_seq_cst);
      const uint32_t seq = wake_seq.load(std::memory_order_seq_cst);
      if (word.load(std::memory_order_seq_cst) == w) futex(&wake_seq, FUTEX_WAIT_PRIVATE, seq);
      sleepers.fetch_sub(1, std::memory_order_relaxed);
    }
  }

  // Workers up to `threads` - 1. A worker inherits its caller's CPU affinity where that holds a
  // CPU for each thread; where the caller is bound to fewer (SGLang binds each OpenMP thread to
  // one core under SGLANG_CPU_OMP_THREADS_BIND), worker k takes OpenMP thread k's. Only then is
  // an OpenMP region entered: in a process forked after its parent's OpenMP threads started, a
  // region never returns.
  void grow(int threads) {
    if (workers >= threads - 1) return;
    std::vector<cpu_set_t> masks(threads);
    std::vector<int> have(threads, 0);
    cpu_set_t mine;
    if (sched_getaffinity(0, sizeof mine, &mine) == 0 && CPU_COUNT(&mine) < threads) {
#pragma omp parallel num_threads(threads)
      {
        const int t = omp_get_thread_num();
        if (t < threads) have[t] = sched_getaffinity(0, sizeof(cpu_set_t), &masks[t]) == 0;
      }
    }
    for (int k = workers + 1; k < threads; ++k) {
      std::thread th([this, k] {
        tls_thread = k;
        worker_loop();
      });
      if (have[k]) pthread_setaffinity_np(th.native_handle(), sizeof(cpu_set_t), &masks[k]);
      th.detach();  // the state is never freed: a worker may outlive static destructors
    }
    workers = threads - 1;
  }
};

std::atomic<State*> state{nullptr};
std::mutex state_made;

void forget_in_child() { state.store(nullptr); }  // pthread_atfork: the parent's workers are gone

State& the_state() {
  State* s = state.load(std::memory_order_acquire);
  if (s) return *s;
  std::lock_guard<std::mutex> lock(state_made);
  s = state.load(std::memory_order_acquire);
  if (!s) {
    static std::once_flag registered;
    std::call_once(registered, [] { pthread_atfork(nullptr, nullptr, forget_in_child); });
    s = new State();
    state.store(s, std::memory_order_release);
  }
  return *s;
}

bool use_openmp() {
  static const bool openmp = [] {
    const char* v = std::getenv("RAGGED_NATIVE_POOL");
    return v && std::string(v) == "openmp";
  }();
  return openmp;
}

void inline_run(int64_t begin, int64_t end, Body body, const void* ctx) {
  const int saved = tls_thread;
  const bool was = tls_in_piece;
  tls_thread = 0;
  tls_in_piece = true;
  body(ctx, begin, end);
  tls_thread = saved;
  tls_in_piece = was;
}

}  // namespace

int threads() { return at::get_num_threads(); }

int thread_num() { return use_openmp() ? at::get_thread_num() : tls_thread; }

const char* kind() { return use_openmp() ? "openmp" : "pool"; }

void run(int64_t begin, int64_t end, int64_t grain, Body body, const void* ctx) {
  if (end <= begin) return;
  if (use_openmp()) {
    at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { body(ctx, b, e); });
    return;
  }
  const int64_t n = end - begin, g = std::max<int64_t>(grain, 1);
  const int t = threads();
  const int64_t pieces = std::min({(n + g - 1) / g, int64_t(t) * PIECES_PER_THREAD, MAX_PIECES});
  if (pieces <= 1 || t <= 1 || tls_in_piece || at::in_parallel_region()) {
    inline_run(begin, end, body, ctx);
    return;
  }
  State& s = the_state();
  std::unique_lock<std::mutex> lock(s.caller, std::try_to_lock);
  if (!lock.owns_lock()) {
    inline_run(begin, end, body, ctx);
    return;
  }
  s.grow(t);
  const int64_t piece = (n + pieces - 1) / pieces;
  const int64_t count = (n + piece - 1) / piece;
  // Publish: the job, then the word (the workers' claims acquire it), then wake any sleeper.
  s.body.store(body, std::memory_order_relaxed);
  s.ctx.store(ctx, std::memory_order_relaxed);
  s.begin.store(begin, std::memory_order_relaxed);
  s.end.store(end, std::memory_order_relaxed);
  s.piece.store(piece, std::memory_order_relaxed);
  s.done.store(0, std::memory_order_relaxed);
  s.active.store(t, std::memory_order_relaxed);
  const uint64_t gen = gen_of(s.word.load(std::memory_order_relaxed)) + 1;
  s.word.store(pack(gen, uint64_t(count)), std::memory_order_seq_cst);
  if (s.sleepers.load(std::memory_order_seq_cst) > 0) {
    s.wake_seq.fetch_add(1, std::memory_order_seq_cst);
    futex(&s.wake_seq, FUTEX_WAKE_PRIVATE, INT_MAX);
  }
  // Take pieces until none is left, then wait for the ones workers took.
  const int saved = tls_thread;
  tls_thread = 0;
  int64_t i;
  while (s.claim(i)) s.run_piece(i);
  tls_thread = saved;
  const auto yield_after = Clock::now() + std::chrono::microseconds(YIELD_AFTER_US);
  while (s.done.load(std::memory_order_acquire) < count) {
    if (Clock::now() < yield_after) {
      RAGGED_PAUSE();
    } else {
      sched_yield();  // a worker that holds a piece may need this core
    }
  }
  if (s.error) std::rethrow_exception(std::exchange(s.error, nullptr));
}

}  // namespace ragged::pool
