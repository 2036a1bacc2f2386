// lowp native kernels: the non-finite test of a gradient's values, shared by the gradient check
// (finite.cpp) and the step's folded check (step.h). A value is non-finite (NaN or +-inf) exactly
// when its exponent field is all ones (IEEE 754-2019, 3.4), so the test is integer-only:
// (bits & exponent_mask) == exponent_mask, 32 bytes at a time.
#pragma once
#include <immintrin.h>
#include <stdint.h>

// true when any of the ``n`` values (uint16_t or uint32_t) has every bit of ``mask`` set
template <typename T> static inline bool any_all_ones(const T *x, int64_t n, T mask) {
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

// Whether elements [start, start + n) of a tensor of dtype code ``dtype`` (0 fp32, 1 bf16, 2 fp16:
// vector.h's Dtype) at ``base`` hold a non-finite value.
static inline bool any_nonfinite(const void *base, int dtype, int64_t start, int64_t n) {
  if (dtype == 0) return any_all_ones<uint32_t>((const uint32_t *)base + start, n, 0x7F800000u);
  return any_all_ones<uint16_t>((const uint16_t *)base + start, n, dtype == 1 ? 0x7F80 : 0x7C00);
}
