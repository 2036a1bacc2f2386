// lowp fused optimizer step for x86-64 CPUs with AVX2 + FMA + F16C (backend="native"), part 1:
// the variant's constants, loads and stores of 16 elements as fp32 vectors, and roundings (the
// vector types and the random bits are simd.h's).
//
// A variant is one generated translation unit (lowp/optim/kernels/native/source.py): the LOWP_*
// macros (write-back mode, every tensor's dtype, state count and roundings, counts of numbers),
// then this header, then the optimizer's rule written out from its spec as `rule` (and
// `reduction` for a per-tensor pre-pass), then step.h, the driver. The loop therefore carries no
// run-time branches on any of these. Every operation rounds as the foreach reference does
// (explicit fused multiply-adds where ATen's CPU kernels use them, correctly rounded sqrt and
// true divisions), so results are bit-identical to it, and stochastic rounding draws the
// counter-based bits of lowp/optim/randomness.py, as every backend.
//
// Layout trick: 16 elements are processed at a time as two fp32 vectors, the even-indexed
// elements ("lo") and the odd-indexed ones ("hi"). A bf16 block of 16 is one 32-byte load; its
// even elements are `x << 16` and its odd ones `x & 0xFFFF0000`, and storing is `hi | lo >> 16`:
// no shuffles at all for bf16 (fp32 and fp16 tensors pay one shuffle pair per 8 elements).
// Elementwise math does not care in which order the lanes hold the elements.
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#ifndef LOWP_MODE_HEADER
#error "a variant defines LOWP_MODE_HEADER, LOWP_MODE_NAN_GUARD, LOWP_MODE_WEIGHT_STREAM, LOWP_MODE_COMPENSATION_STREAM, LOWP_W, LOWP_G, LOWP_B, LOWP_NSTATES, LOWP_STATE_TYPES, LOWP_SR, LOWP_COUNT, LOWP_NUMBERS, LOWP_TENSOR_NUMBERS and LOWP_REDUCTION"
#endif

enum Dtype { F32 = 0, BF16 = 1, F16 = 2, I16 = 3, I8 = 4 };

// What the write-back mode (lowp/optim/writeback/<mode>.py, its code in LOWP_MODE_HEADER) asks of the
// kernel: the random streams it draws and whether its buffer passes NaN bits on.
constexpr bool MODE_WEIGHT_STREAM = LOWP_MODE_WEIGHT_STREAM != 0, MODE_COMPENSATION_STREAM = LOWP_MODE_COMPENSATION_STREAM != 0;
constexpr bool MODE_NAN_GUARD = LOWP_MODE_NAN_GUARD != 0;
constexpr int NSTATES = LOWP_NSTATES;
constexpr int WT = LOWP_W, GT = LOWP_G, BT = LOWP_B;
constexpr int ST[NSTATES + 1] = LOWP_STATE_TYPES;  // one entry past the states (F32), so the array is never empty
constexpr bool SR = LOWP_SR != 0, COUNT = LOWP_COUNT != 0, REDUCTION = LOWP_REDUCTION != 0;
constexpr int NUMBERS = LOWP_NUMBERS, TENSOR_NUMBERS = LOWP_TENSOR_NUMBERS;
constexpr bool states_known() {
  for (int j = 0; j < NSTATES; j++)
    if (ST[j] > F16) return false;
  return true;
}
static_assert(WT <= F16 && GT <= F16 && BT <= I8 && states_known(), "unknown dtype");

constexpr int BLOCK = 2 * LANES;  // elements per block: the even and the odd lanes

// ---- loads and stores of a block as (even, odd) fp32 vectors ---------------------------------
// The fp16 conversions (F16C, AVX-512F) and the lane shuffles of fp32 and fp16 tensors at each width.
#if LOWP_LANES == 16
static inline void deinterleave(vf a, vf b, vf &even, vf &odd) {
  // a = elements 0..15, b = 16..31 -> even = 0,2,..,30 and odd = 1,3,..,31
  const __m512i e = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  even = (vf)_mm512_permutex2var_ps((__m512)a, e, (__m512)b);
  odd = (vf)_mm512_permutex2var_ps((__m512)a, _mm512_add_epi32(e, _mm512_set1_epi32(1)), (__m512)b);
}
static inline void interleave(vf even, vf odd, vf &a, vf &b) {
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  a = (vf)_mm512_permutex2var_ps((__m512)even, lo, (__m512)odd);
  b = (vf)_mm512_permutex2var_ps((__m512)even, _mm512_add_epi32(lo, _mm512_set1_epi32(8)), (__m512)odd);
}
static inline vf from_f16(const void *p) { return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
template <int ROUNDING> static inline half_vector to_f16(vf x) { return _mm512_cvtps_ph((__m512)x, ROUNDING); }
static inline void store_f16(void *p, half_vector h) { _mm256_storeu_si256((__m256i *)p, h); }
static inline vf floor_(vf x) { return (vf)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
#else
static inline void deinterleave(vf a, vf b, vf &even, vf &odd) {
  // a = elements 0..7, b = 8..15 -> even = 0,2,..,14 and odd = 1,3,..,15
  even = (vf)_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps((__m256)a, (__m256)b, 0x88)), 0xD8));
  odd = (vf)_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps((__m256)a, (__m256)b, 0xDD)), 0xD8));
}

static inline void interleave(vf even, vf odd, vf &a, vf &b) {
  __m256 e = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd((__m256)even), 0xD8));
  __m256 o = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd((__m256)odd), 0xD8));
  a = (vf)_mm256_unpacklo_ps(e, o);
  b = (vf)_mm256_unpackhi_ps(e, o);
}
static inline vf from_f16(const void *p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
template <int ROUNDING> static inline half_vector to_f16(vf x) { return _mm256_cvtps_ph((__m256)x, ROUNDING); }
static inline void store_f16(void *p, half_vector h) { _mm_storeu_si128((__m128i *)p, h); }
static inline vf floor_(vf x) { return (vf)_mm256_floor_ps((__m256)x); }
#endif

template <int DT> static inline void load(const void *base, int64_t i, vf &lo, vf &hi) {
  if constexpr (DT == BF16) {
    vu x;
    memcpy(&x, (const uint16_t *)base + i, sizeof(vu));
    lo = (vf)(x << 16);
    hi = (vf)(x & 0xFFFF0000u);
  } else if constexpr (DT == F16) {
    const uint16_t *p = (const uint16_t *)base + i;
    deinterleave(from_f16(p), from_f16(p + LANES), lo, hi);
  } else {
    vf a, b;
    memcpy(&a, (const float *)base + i, sizeof(vf));
    memcpy(&b, (const float *)base + i + LANES, sizeof(vf));
    deinterleave(a, b, lo, hi);
  }
}

// States kept as block-scaled codes (coded_step.h): per state its CodeKind (codes.h), -1 for a
// plain state; CODE_SCALE: the dtype of their block scales (simd.h's ScaleType).
#ifdef LOWP_CODE_KINDS
constexpr int CODE_KINDS[NSTATES + 1] = LOWP_CODE_KINDS;
constexpr int CODE_SCALE = LOWP_CODE_SCALE;
constexpr bool coded_state(int j) { return CODE_KINDS[j] >= 0; }
#else
constexpr int CODE_SCALE = SCALE_BF16;  // no state is coded: all_states_bf16 never asks
constexpr bool coded_state(int) { return false; }
#endif

// NaN guard of the bf16 roundings below. Adding up to 0xFFFF to the bit pattern can carry a NaN
// into the sign bit (0x7FFFFFFF + 0x8000 is -0.0) only when its low 16 bits are not all zero.
// Every NaN of a variant whose floating-point inputs are all bf16 has zero low bits: loaded bf16
// values do, the hardware's default NaN (0xFFC00000) does, and arithmetic passes a NaN operand's
// payload on. A coded state decodes to q * s (squared for unsigned codes), whose NaNs are its
// block scale's or, for fp8 codes, the code's own (torch widens every fp8 NaN to a pattern with
// zero low bits), so bf16 block scales count as bf16 inputs. Only variants reading fp32 or fp16
// tensors (or scales) pay for the guard (a compare and a blend per rounding). The exact modes'
// weights carry a remainder in their low bits, which a NaN weight passes on to the states
// (through weight decay), so they pay too.
constexpr bool all_states_bf16() {
  for (int j = 0; j < NSTATES; j++)
    if (coded_state(j) ? CODE_SCALE != SCALE_BF16 : ST[j] != BF16) return false;
  return true;
}
constexpr bool NAN_GUARD = WT != BF16 || GT != BF16 || MODE_NAN_GUARD || !all_states_bf16();

static inline vf nan_guard(vf x, vu rounded) {
  if constexpr (NAN_GUARD) return (vf)((x != x) ? bcu(0x7FC00000u) : rounded);
  else return (vf)rounded;
}

// fp32 -> the nearest bf16 (ties to even), as an fp32 value.
static inline vf round_bf16(vf x) {
  vu u = (vu)x;
  return nan_guard(x, (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
}

// fp32 -> bf16 with stochastic rounding: add 16 random bits to the pattern and truncate. A NaN
// keeps its sign and top payload bits with the quiet bit set (lowp/optim/storage.py); without the
// guard (all-bf16 variants) every NaN already is such a value, which the rounding leaves alone.
static inline vf stochastic_bf16(vf x, vu noise) {
  vu rounded = ((vu)x + noise) & 0xFFFF0000u;
  if constexpr (NAN_GUARD) return (vf)((x != x) ? (((vu)x & 0xFFFF0000u) | 0x00400000u) : rounded);
  else return (vf)rounded;
}

static inline vf round_f16(vf x) { return f16_to_f32(to_f16<_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC>(x)); }

// fp32 -> fp16 with stochastic rounding, 16 random bits: with t = x truncated toward zero and
// ulp the fp16 spacing above |t| (2^(e-10), at least 2^-24 in the subnormal range), round away
// from zero when floor(frac * 2^16) + noise >= 2^16, frac = (|x| - |t|) / ulp (exact: Sterbenz,
// and ulp is a power of two). P(up) = frac for normal fp16 values (13 dropped bits < 16); beyond
// 65504 + ulp the result is +-inf (65536 stores as inf), and inf and NaN stay themselves.
static inline vf stochastic_f16(vf x, vu noise) {
  const vu sign_bit = bcu(0x80000000u);
  vf t = f16_to_f32(to_f16<_MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC>(x));
  vf at = (vf)((vu)t & ~sign_bit), ax = (vf)((vu)x & ~sign_bit);
  vf spacing = (vf)((vu)at & 0x7F800000u) * bc(0x1p-10f);
  vf ulp = select(spacing > bc(0x1p-24f), spacing, bc(0x1p-24f));
  vf frac = (ax - at) / ulp;
  vf drawn = floor_(frac * bc(65536.0f)) + int_to_float(noise);
  vf r = select(drawn >= bc(65536.0f), at + ulp, at);
  return select(x != x, x, (vf)((vu)r | ((vu)x & sign_bit)));
}

// ``x`` rounded to the nearest value of DT (ties to even), still as fp32.
template <int DT> static inline vf round_to(vf x) {
  if constexpr (DT == BF16) return round_bf16(x);
  else if constexpr (DT == F16) return round_f16(x);
  else return x;
}

// Store values that are already representable in DT (so the conversion is exact).
template <int DT> static inline void store(void *base, int64_t i, vf lo, vf hi) {
  if constexpr (DT == BF16) {
    vu x = ((vu)hi & 0xFFFF0000u) | ((vu)lo >> 16);
    memcpy((uint16_t *)base + i, &x, sizeof(vu));
  } else {
    vf a, b;
    interleave(lo, hi, a, b);
    if constexpr (DT == F16) {
      uint16_t *p = (uint16_t *)base + i;
      store_f16(p, to_f16<_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC>(a));
      store_f16(p + LANES, to_f16<_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC>(b));
    } else {
      memcpy((float *)base + i, &a, sizeof(vf));
      memcpy((float *)base + i + LANES, &b, sizeof(vf));
    }
  }
}

// ---- what a rule reads besides the tensors ------------------------------------------------------
// The step's numbers (computed on the host in float64 by the spec, rounded once to fp32 here) as
// vectors broadcast once per call; the float64 values stay for per-tensor host-side work.
struct Numbers {
  double d[NUMBERS > 0 ? NUMBERS : 1];
  vf v[NUMBERS > 0 ? NUMBERS : 1];
  void set(const double *h) {
    for (int j = 0; j < NUMBERS; j++) {
      d[j] = h[j];
      v[j] = bc((float)h[j]);
    }
  }
};

// The operations of lowp/optim/rule.py that are not plain vector arithmetic.
static inline vf maximum(vf a, vf b) { return select((a != a) | (a > b), a, b); }  // NaN propagates

static inline vf sign(vf x) {  // torch.sign on CPU: NaN gives 0 (both compares are false)
  return select(x > 0.0f, bc(1.0f), select(x < 0.0f, bc(-1.0f), bc(0.0f)));
}
