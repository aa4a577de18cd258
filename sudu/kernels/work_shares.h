// The work split of the quantized products: a call's work items (tiles, tile pairs) over the threads of one
// parallel region, each thread streaming a contiguous share and then taking chunks from the back of the others'.
#pragma once
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace qtiles {

// Chunks per thread that run_jobs cuts the tiles into.
constexpr int64_t CHUNKS_PER_THREAD = 8;

// A thread's share of a call's tiles [lo, hi), in one word, so that its owner (taking chunks from the
// front) and a thread done with its own share (taking them from the back) never take the same tile.
struct alignas(64) Share {
  std::atomic<uint64_t> v;
  static uint64_t pack(int64_t lo, int64_t hi) { return static_cast<uint64_t>(lo) << 32 | static_cast<uint64_t>(hi); }
  void set(int64_t lo, int64_t hi) { v.store(pack(lo, hi), std::memory_order_relaxed); }
  // Up to n tiles [a, b) from the front (or the back); false when none are left.
  bool take(int64_t n, bool front, int64_t& a, int64_t& b) {
    uint64_t cur = v.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t lo = static_cast<int64_t>(cur >> 32), hi = static_cast<int64_t>(cur & 0xffffffffu);
      if (lo >= hi) return false;
      a = front ? lo : std::max(lo, hi - n);
      b = front ? std::min(hi, lo + n) : hi;
      if (v.compare_exchange_weak(cur, front ? pack(b, hi) : pack(lo, a), std::memory_order_relaxed)) return true;
    }
  }
};

// Work items [0, total) (a call's tiles as one range over its jobs, or qlinear_silu's tile pairs) over the
// threads, run_range(a, b) for chunks of them: one fork and join for all. Each thread streams its own
// contiguous share of the tiles, a chunk at a time, so its weights are one stream that the prefetches
// (PREFETCH_BYTES ahead) carry from chunk to chunk; with chunks from a shared counter in turn, every chunk
// starts a new stream, which decode steps measured slower (docs/cpu_speed.md). A thread done with its
// share takes chunks from the back of the others', so a thread the OS preempts (another process waking on
// its core) leaves its remaining chunks to the rest instead of holding every thread at the join. A tile's
// outputs do not depend on which thread or call computes it.
// contiguous = false: one share for all, which every thread takes chunks of from the front, in turn
// (KernelOptions::contiguous_shares, so benchmarks can compare the two; the same results).
template <typename F>
void run_shares(int64_t total, bool contiguous, F&& run_range) {
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  if (threads <= 1 || total < 2 * threads) {
    at::parallel_for(0, total, 1, run_range);
    return;
  }
  const int64_t chunk = std::max<int64_t>(1, total / (threads * CHUNKS_PER_THREAD));
  TORCH_CHECK(total < (int64_t(1) << 31), "run_shares: too many work items");
  // one share per thread; without contiguous shares, one for all, which every thread takes from the front
  const int64_t n_shares = contiguous ? threads : 1;
  std::unique_ptr<Share[]> shares(new Share[n_shares]);
  for (int64_t i = 0; i < n_shares; ++i) shares[i].set(total * i / n_shares, total * (i + 1) / n_shares);
  // each index of [0, threads) owns a share; a thread that gets several indices runs them in turn
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    int64_t a, b;
    for (int64_t own = begin; own < end; ++own)
      while (shares[own % n_shares].take(chunk, true, a, b)) run_range(a, b);
    for (int64_t k = 1; k < n_shares; ++k)
      while (shares[(begin + k) % n_shares].take(chunk, false, a, b)) run_range(a, b);
  });
}

}  // namespace qtiles
