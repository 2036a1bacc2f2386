// lowp: which gradients hold a non-finite value (NaN or +-inf), for every tensor in one call
// (backend="native"). A value is non-finite exactly when its exponent field is all ones, so the
// test is integer-only: (bits & exponent_mask) == exponent_mask, 16 or 8 lanes at a time, read
// once at memory speed on ``threads`` OpenMP threads (units of 2^16 elements shared through a counter).
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <vector>

#include "parallel.h"

enum Dtype { F32 = 0, BF16 = 1, F16 = 2 };
static constexpr int64_t UNIT = 1 << 16;

// true when any of the ``n`` values (uint16_t or uint32_t) has every bit of ``mask`` set
template <typename T> static bool any_all_ones(const T *x, int64_t n, T mask) {
  constexpr bool WIDE = sizeof(T) == 4;
  constexpr int64_t LANES = 32 / sizeof(T);
  const __m256i m = WIDE ? _mm256_set1_epi32((int)mask) : _mm256_set1_epi16((short)mask);
  __m256i hit = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    __m256i v = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)), m);
    hit = _mm256_or_si256(hit, WIDE ? _mm256_cmpeq_epi32(v, m) : _mm256_cmpeq_epi16(v, m));
  }
  bool found = !_mm256_testz_si256(hit, hit);
  for (; i < n; i++) found |= (x[i] & mask) == mask;
  return found;
}

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
    bool found = dtypes[t] == F32 ? any_all_ones<uint32_t>((const uint32_t *)ptrs[t] + u.start, n, 0x7F800000u)
                                  : any_all_ones<uint16_t>((const uint16_t *)ptrs[t] + u.start, n,
                                                           dtypes[t] == BF16 ? 0x7F80 : 0x7C00);
    if (found) bad[t].store(1, std::memory_order_relaxed);
  }
  for (int64_t t = 0; t < tensors; t++) flags[t] = !bad[t].load();
}
