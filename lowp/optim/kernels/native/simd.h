// lowp native kernels: the fp32 vectors of 8 lanes (GCC vector extensions over AVX2) and the
// counter-based random bits that every kernel shares (the step of vector.h/step.h and the codec
// of codes.h). Nothing here depends on a variant's macros.
#pragma once
#include <immintrin.h>
#include <stdint.h>

typedef float vf __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));

static inline vf bc(float x) { return (vf)_mm256_set1_ps(x); }
static inline vu bcu(uint32_t x) { return (vu)_mm256_set1_epi32((int)x); }
static inline vf fma_(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
static inline vf sqrt_(vf a) { return (vf)_mm256_sqrt_ps((__m256)a); }  // correctly rounded
static inline vf select(vi mask, vf a, vf b) { return mask ? a : b; }

// ---- counter-based random bits (lowp/optim/randomness.py) ---------------------------------------
// random16(i, key) = hash32(lo32(i) ^ key ^ hash32(hi32(i))) >> 16. The key with the high half
// folded in is computed per block on the host side of the vectors (scalar_hash32); hash32's last
// xor-shift leaves the top 16 bits alone, so random16 skips it.
static inline uint32_t scalar_hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

static inline vu random16(vu x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x >> 16;
}

