// lowp native kernels: the fp32 vectors of 8 or 16 lanes (GCC vector extensions over AVX2 or AVX-512) and the
// counter-based random bits that every kernel shares (the step of vector.h/step.h and the codec
// of codes.h). Nothing here depends on a variant's macros.
#pragma once
#include <immintrin.h>
#include <stdint.h>

// Lanes per fp32 vector: 16 (512 bits) in an AVX-512 build of a translation unit that asks for wide
// vectors (LOWP_WIDE: every step variant, coded ones included), else 8 (256 bits: the AVX2 build and
// the codec of codes.cpp). A block of a kernel is 2 * LANES elements, held as its even- and
// odd-indexed elements; each element's arithmetic is the same at either width, so both give the
// same bits.
#if defined(__AVX512F__) && defined(LOWP_WIDE)
#define LOWP_LANES 16
#else
#define LOWP_LANES 8
#endif
constexpr int LANES = LOWP_LANES;
typedef float vf __attribute__((vector_size(4 * LOWP_LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * LOWP_LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LOWP_LANES)));

// The dtype of the block scales of coded states (lowp.optim.kernels.native.codec.scale_code).
enum ScaleType { SCALE_F32 = 0, SCALE_BF16 = 1, SCALE_F16 = 2 };

typedef uint16_t vh __attribute__((vector_size(2 * LOWP_LANES)));  // LANES lanes of 16 bits
typedef int16_t vhs __attribute__((vector_size(2 * LOWP_LANES)));  // the same, signed

// Vectors of 8 lanes at either width: the scales of up to 8 blocks (codes.h's block_scales).
typedef float vf8 __attribute__((vector_size(32)));
typedef uint32_t vu8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
static inline vf8 bc8(float x) { return (vf8)_mm256_set1_ps(x); }
static inline vu8 bcu8(uint32_t x) { return (vu8)_mm256_set1_epi32((int)x); }

// Broadcasts (exact: -0.0 stays -0.0, which adding x to a zero vector would not keep), and the
// conversions at each width: fp16 -> fp32 (exact), int32 -> fp32 (signed lanes, rounded to nearest),
// fp32 -> int32 truncated (cvtt: 0x80000000 out of range), fp32 rounded to an integer, ties to even,
// the low 16 bits of each lane, and 16-bit lanes widened to 32 (zero- or sign-extended: one
// vpmovzxwd / vpmovsxwd, where __builtin_convertvector gave GCC two half-width ones and an insert).
#if LOWP_LANES == 16
static inline vf bc(float x) { return (vf)_mm512_set1_ps(x); }
static inline vu bcu(uint32_t x) { return (vu)_mm512_set1_epi32((int)x); }
static inline vf fma_(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
static inline vf sqrt_(vf a) { return (vf)_mm512_sqrt_ps((__m512)a); }  // correctly rounded
typedef __m256i half_vector;  // LANES fp16 values
static inline vf f16_to_f32(half_vector h) { return (vf)_mm512_cvtph_ps(h); }
static inline vf int_to_float(vu x) { return (vf)_mm512_cvtepi32_ps((__m512i)x); }
static inline vi truncate_(vf x) { return (vi)_mm512_cvttps_epi32((__m512)x); }
static inline vf round_even_(vf x) { return (vf)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vh low_halves(vu x) { return (vh)_mm512_cvtepi32_epi16((__m512i)x); }
static inline vu widen(vh x) { return (vu)_mm512_cvtepu16_epi32((__m256i)x); }
static inline vi widen(vhs x) { return (vi)_mm512_cvtepi16_epi32((__m256i)x); }
#else
static inline vf bc(float x) { return (vf)_mm256_set1_ps(x); }
static inline vu bcu(uint32_t x) { return (vu)_mm256_set1_epi32((int)x); }
static inline vf fma_(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
static inline vf sqrt_(vf a) { return (vf)_mm256_sqrt_ps((__m256)a); }  // correctly rounded
typedef __m128i half_vector;  // LANES fp16 values
static inline vf f16_to_f32(half_vector h) { return (vf)_mm256_cvtph_ps(h); }
static inline vf int_to_float(vu x) { return (vf)_mm256_cvtepi32_ps((__m256i)x); }
static inline vi truncate_(vf x) { return (vi)_mm256_cvttps_epi32((__m256)x); }
static inline vf round_even_(vf x) { return (vf)_mm256_round_ps((__m256)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vh low_halves(vu x) {  // packus saturates: the lanes are cut to 16 bits first
  const __m256i low = _mm256_and_si256((__m256i)x, _mm256_set1_epi32(0xFFFF));
  return (vh)_mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(low, low), 0x08));
}
static inline vu widen(vh x) { return (vu)_mm256_cvtepu16_epi32((__m128i)x); }
static inline vi widen(vhs x) { return (vi)_mm256_cvtepi16_epi32((__m128i)x); }
#endif
static inline vf select(vi mask, vf a, vf b) { return mask ? a : b; }

// ---- counter-based random bits (lowp/optim/randomness.py) ---------------------------------------
// random16(i, key) = half (i & 1) of hash32(lo32(p) ^ key ^ hash32(hi32(p))) for the pair p = i / 2:
// elements 2k and 2k + 1 take the low and the high 16 bits of one hash. Per 2^32 elements of one
// hi = hi32(i), lo32(p) = lo32(i) / 2 + (hi & 1) 2^31: the lanes xor lo32(i) / 2 with the key folded
// with hash32(hi / 2) and that top bit (fold_key), computed per block on the host side of the
// vectors (scalar_hash32, FoldedKeys).
static inline uint32_t scalar_hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// lowp/optim/randomness.py's fold_key: the key of the indices whose high half is ``hi``.
static inline uint32_t fold_key(uint32_t key, uint64_t hi) {
  return key ^ scalar_hash32((uint32_t)(hi >> 1)) ^ ((uint32_t)(hi & 1) << 31);
}

// The stream keys of one parameter at one step, as lowp/optim/randomness.py's stream_keys (bit for
// bit): x = splitmix64 of the seed, then of x ^ step, then of x ^ param_id; key s = the low 32 bits
// of splitmix64(x ^ s) (Steele, Lea and Flood, "Fast splittable pseudorandom number generators",
// OOPSLA 2014).
static inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
static inline void stream_keys(uint64_t seed, uint64_t step, uint64_t param_id, int streams, uint32_t *keys) {
  const uint64_t x = splitmix64(splitmix64(splitmix64(seed) ^ step) ^ param_id);
  for (int s = 0; s < streams; s++) keys[s] = (uint32_t)splitmix64(x ^ (uint64_t)s);
}

// hash32's first step, x ^ (x >> 16), is linear over xor: mix(lo ^ key) = mix(lo) ^ mix(key). A
// caller hashing one index under several keys mixes the index once and each key once.
static inline vu mix16(vu x) { return x ^ (x >> 16); }
static inline uint32_t mix16(uint32_t x) { return x ^ (x >> 16); }

// hash32 of x whose first step is done (mixed = mix16(x)), but for its last xor-shift, which leaves
// the top 16 bits alone: high16 and low16 read hash32's two halves from it.
static inline vu hash32_mixed(vu mixed) {
  vu x = mixed * 0x7FEB352Du;
  x ^= x >> 15;
  return x * 0x846CA68Bu;
}
static inline vu high16(vu unfinished) { return unfinished >> 16; }
static inline vu low16(vu unfinished) { return (unfinished ^ (unfinished >> 16)) & 0xFFFFu; }

// random16 of lanes whose low index halves are ``lo`` under a key (folded, not mixed) per lane.
static inline vu random16(vu lo, vu key) {
  const vu x = hash32_mixed(mix16((lo >> 1) ^ key));
  return (lo & 1u) != 0u ? high16(x) : low16(x);
}

// The keys of N random streams folded with the high half of an element index, cached for the
// high half ``hi`` of the last block seen: k0[s] = fold_key(key[s], hi) and, for the lanes of a
// block that cross into the next multiple of 2^32, k1[s] = fold_key(key[s], hi + 1). The step
// (step.h, the streams of a tensor, 16 elements as even and odd lanes) and the codec (codes.h, one
// stream, 8 consecutive elements) lay the lanes out differently; the keys are these.
template <int N> struct FoldedKeys {
  uint64_t hi = ~0ull;
  uint32_t k0[N] = {}, k1[N] = {};

  // Fold ``keys`` (N stream keys) for a block whose element 0 has index ``first``, unless done.
  inline void fold(const uint32_t *keys, uint64_t first) {
    if ((first >> 32) == hi) return;
    hi = first >> 32;
    for (int s = 0; s < N; s++) {
      k0[s] = fold_key(keys[s], hi);
      k1[s] = fold_key(keys[s], hi + 1);
    }
  }
  // Stream s's key per lane for the low index halves ``lanes`` of a block whose element 0 has low
  // half ``lo``: k1 in the lanes past a multiple of 2^32 (those below ``lo``), else k0.
  inline vu wrapped(int s, vu lanes, uint32_t lo) const {
    return bcu(k0[s]) ^ ((vu)(lanes < bcu(lo)) & bcu(k0[s] ^ k1[s]));
  }
};
