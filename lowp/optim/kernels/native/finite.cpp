// lowp: which gradients hold a non-finite value (NaN or +-inf), for every tensor in one call
// (backend="native"; finite.h's integer test of the exponent field), read once at memory speed on
// ``threads`` OpenMP threads (units of 2^16 elements shared through a counter).
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <vector>

#include "finite.h"
#include "parallel.h"

static constexpr int64_t UNIT = 1 << 16;

// flags[t] = 1 when tensor t is all finite, else 0
extern "C" void lowp_finite(int64_t tensors, void *const *ptrs, const int64_t *numel, const int32_t *dtypes,
                            uint8_t *flags, int threads) {
  Units<UNIT> units(tensors, numel);
  std::vector<std::atomic<uint8_t>> bad(tensors);
  for (auto &b : bad) b.store(0);
#pragma omp parallel num_threads(thread_count(threads, units.count()))  // on torch's OpenMP pool (see step.h)
  for (Unit u; units.take(u);) {
    const int64_t t = u.tensor, n = u.end - u.start;
    if (bad[t].load(std::memory_order_relaxed)) continue;
    if (any_nonfinite(ptrs[t], dtypes[t], u.start, n)) bad[t].store(1, std::memory_order_relaxed);
  }
  for (int64_t t = 0; t < tensors; t++) flags[t] = !bad[t].load();
}
