// The native kernels' own thread pool (pool.cpp: how it works and why).
//
// ragged::pool::parallel_for(begin, end, grain, f) runs f(b, e) over pieces of [begin, end) as
// at::parallel_for does, with one difference that decides a served decode step on a CPU: the
// caller never waits for a worker to wake up. It publishes the pieces, takes them itself, and
// waits only for pieces a worker has already taken; a worker that wakes late finds none left.
// Under at::parallel_for (OpenMP) the caller waits at the region's barrier for every worker,
// asleep or not, and a decode step runs some 150 regions of 10-100 us each.
#pragma once

#include <cstdint>

namespace ragged::pool {

using Body = void (*)(const void* ctx, int64_t begin, int64_t end);

// f(ctx, b, e) over [begin, end) in pieces of at least `grain` (all on the caller where the
// range is one piece, the pool has one thread, is busy or the caller is inside a parallel region).
void run(int64_t begin, int64_t end, int64_t grain, Body body, const void* ctx);

// Which thread runs the current piece: 0 the caller, 1 .. threads() - 1 the workers (a
// per-thread workspace's index, as at::get_thread_num() under at::parallel_for).
int thread_num();

// How many threads the next run may use: torch's intra-op thread count (at::get_num_threads()).
int threads();

// "pool" (this pool) or "openmp" (at::parallel_for), from RAGGED_NATIVE_POOL at first use.
const char* kind();

template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  run(begin, end, grain,
      [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); }, &f);
}

}  // namespace ragged::pool
