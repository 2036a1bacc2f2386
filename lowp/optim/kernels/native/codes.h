// lowp block-scaled codes (lowp/optim/codes.py) in C++: encode and decode one block of B <= 256
// elements, bit for bit as the torch definition does it. Included by codes.cpp (the codec's
// multi-tensor entry points) and coded_step.h (the step that codes its states in registers).
//
// The grid's numbers (Q, m, emin, signed) come from the Python Code at run time; what changes the
// loads and stores is a template parameter: the storage KIND, whose Storage<KIND> each encoding's
// header specializes beside its module (lowp/optim/encodings/<name>.h), and the scale dtype S (the
// numbering of vector.h's Dtype: fp32, bf16, fp16).
//
//   encode:  t = x or sqrt(x); s = up(max|t| / Q) (NaN when the block holds a NaN or an infinity);
//            k = 1 / s (once per block); y = t * k (t / s where k is not finite; 0 where y is not
//            finite); a = |y|; spacing = max(2^e(a), 2^emin) * 2^-m; c = a / spacing;
//            q = min(max(R(c) * spacing, L), Q), with y's sign for signed codes, L = 0 (signed
//            codes) or 1 (unsigned codes never hold 0)
//   decode:  y = q * s, squared for unsigned codes
//
// c = a / spacing is exact (a power-of-two scaling of a value below 2^(m+1)), so multiplying by
// the reciprocal of the spacing (a power of two, built from its exponent bits) gives the same
// bits as torch's division. Stochastic rounding in fixed point: with F = floor(c * 2^16) (exact
// scaling, F < 2^25), floor(c) + [floor(frac(c) * 2^16) + r >= 2^16] = (F + r) >> 16, the
// definition's two floors and compare in one integer add and shift. Integer codes (emin = m,
// Q < 2^(m+1)) have spacing 1 for every |y| <= Q(1 + 2^-22), so c = a; a block whose scale is
// positive and whose k * 2^16 is finite (no NaN, infinity or zero in sight) takes F = floor(|t| *
// (k * 2^16)) directly: k * 2^16 is exact, so |t| * (k * 2^16) = fl(|t| * k) * 2^16 (a result
// below 2^-126 gives F = 0 both ways). fp8 codes round stochastically in the bits of such a block
// (code_lanes).
#pragma once
#include <float.h>
#include <math.h>
#include <string.h>

#include "simd.h"

// One encoding's storage, specialized by its header (lowp/optim/encodings/<name>.h, the KIND its
// Python module numbers it with):
//   BITS: 8 or 4 (two codes per byte, element 2k in the low nibble of byte k);
//   SIGNED: the code holds values linearly (else the square roots of nonnegative states, 1..Q);
//   FP8: the grid is an fp8 format's (code_lanes rounds in its bits);
//   load8(codes, j) / store8(codes, j, v): the codes of elements j .. j + 7 (4-bit codes: j even)
//     as 8 fp32 values / from code_lanes' 8 int32 lanes (the codec of codes.cpp);
//   load_lanes(codes, i, even, odd) / store_lanes(codes, i, even, odd): the 2 * LANES elements
//     from i (a multiple of 2 * LANES) as (even, odd) lanes, as coded_step.h holds them.
template <int KIND> struct Storage;
// byte offset of element ``i``'s code
template <int KIND> static inline int64_t code_offset(int64_t i) { return Storage<KIND>::BITS == 4 ? i / 2 : i; }
// bytes of ``n`` codes
template <int KIND> static inline int64_t code_bytes(int64_t n) { return Storage<KIND>::BITS == 4 ? (n + 1) / 2 : n; }
constexpr int MAX_BLOCK = 256;

// The grid of one code (lowp.optim.codes.Code), broadcast once per call.
struct Grid {
  float q;                   // Q (block_scales divides by it in 8-lane vectors)
  vf top, least;             // Q, and L: 0 for signed codes, 1 for unsigned ones (which never hold 0)
  vf min_binade, inv_mantissa, sub_scale;
  vi top_code, least_code;  // Q and L as integers (integer codes)
  vf sub_fixed;              // fp8 subnormals: 2^(m - emin + 16), c * 2^16 of the fixed path
  vu normal_shift, normal_bias, fixed_shift;
  vu fixed_bias, top_fixed;  // fp8's fixed path: normal_bias and the byte of Q, times 2^16

  Grid(int is_signed, float q_, int m, int emin) : q(q_) {
    top = bc(q);
    least = bc(is_signed ? 0.0f : 1.0f);
    top_code = (vi)bcu((uint32_t)q);
    least_code = (vi)bcu(is_signed ? 0u : 1u);
    min_binade = bc(ldexpf(1.0f, emin));
    inv_mantissa = bc(ldexpf(1.0f, -m));
    sub_scale = bc(ldexpf(1.0f, m - emin));                 // fp8 subnormals: q / 2^(emin - m)
    normal_shift = bcu((uint32_t)(23 - m));                 // fp8 normals: fp32 bits >> (23 - m)
    const uint32_t bias = (uint32_t)((127 - (1 - emin)) << m);
    normal_bias = bcu(bias);  // minus the exponent bias difference
    sub_fixed = bc(ldexpf(1.0f, m - emin + 16));
    fixed_shift = bcu((uint32_t)(7 - m));                   // fp8 normals: c * 2^16 = fp32 bits >> (7 - m)
    uint32_t top_bits;
    memcpy(&top_bits, &q, 4);
    fixed_bias = bcu(bias << 16);
    top_fixed = bcu(((top_bits >> (23 - m)) - bias) << 16);  // fp8: the byte of Q
  }
};

// Unsigned codes (the square roots of nonnegative states) by their storage kind.
template <int KIND> constexpr bool unsigned_kind() { return !Storage<KIND>::SIGNED; }
template <int KIND> constexpr bool fp8_kind() { return Storage<KIND>::FP8; }

// ---- block scales ------------------------------------------------------------------------------
template <int S> static inline float scale_at(const void *scales, int64_t b) {
  if constexpr (S == SCALE_F32) {
    return ((const float *)scales)[b];
  } else if constexpr (S == SCALE_BF16) {
    uint32_t bits = (uint32_t)((const uint16_t *)scales)[b] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
  } else {
    return _cvtsh_ss(((const uint16_t *)scales)[b]);
  }
}

// ---- the scales of up to 8 blocks, and the codes of a vector of values of a block ----------------
// |t| as bits, whose unsigned maximum over a block is the bits of max |t| (NaN and infinity above
// every finite value): the block's peak, one integer max per vector of values.
static inline vu peak_of(vu peak, vf t) {
  const vu a = (vu)t & 0x7FFFFFFFu;
  return a > peak ? a : peak;
}

// The largest lane of ``v`` is the largest of the 8 lanes returned (unsigned).
static inline vu8 peak8(vu v) {
#if LOWP_LANES == 16
  const vu8 low = (vu8)_mm512_castsi512_si256((__m512i)v), high = (vu8)_mm512_extracti64x4_epi64((__m512i)v, 1);
  return low > high ? low : high;
#else
  return v;
#endif
}

// Lane b: the largest lane of v[b] (unsigned), for 8 vectors at once: a tree of shuffles as
// _mm256_hadd_ps sums 8 vectors, with max in place of the sum.
static inline vu8 lane_maxima(const vu8 v[8]) {
  // lanes a0|a1, a2|a3, b0|b1, b2|b3 of each 128-bit half (| is max)
  auto pairs = [](vu8 a, vu8 b) {
    return (vu8)_mm256_max_epu32((__m256i)_mm256_shuffle_ps((__m256)a, (__m256)b, 0x88),
                                 (__m256i)_mm256_shuffle_ps((__m256)a, (__m256)b, 0xDD));
  };
  const vu8 low = pairs(pairs(v[0], v[1]), pairs(v[2], v[3]));   // half h, lane j: half h of v[j]
  const vu8 high = pairs(pairs(v[4], v[5]), pairs(v[6], v[7]));  // the same for v[4 + j]
  return (vu8)_mm256_max_epu32(_mm256_permute2x128_si256((__m256i)low, (__m256i)high, 0x20),
                               _mm256_permute2x128_si256((__m256i)low, (__m256i)high, 0x31));
}

// One block's stored scale s, its reciprocal k (y = t * k, or t / s where k is not finite), and
// k * 2^16 for the fixed-point shortcut of integer codes (``fixed``: s > 0 and k * 2^16 finite).
struct BlockScale {
  vf s, k, k16;
  bool divide, fixed;
};

// The BlockScales of up to 8 consecutive blocks, lane b for block b (``divide``, ``fixed``: bit b).
struct BlockScales {
  vf8 s, k, k16;
  int divide, fixed;
  inline BlockScale operator[](int b) const {
    return BlockScale{bc(s[b]), bc(k[b]), bc(k16[b]), ((divide >> b) & 1) != 0, ((fixed >> b) & 1) != 0};
  }
};

// The scales of the ``n`` (<= 8) blocks from ``b0`` on, from the bits of their peaks |t| (lane b:
// block b0 + b; >= 0x7F800000: a NaN or an infinity, whose scale is NaN): s = peak / Q rounded up
// to S and stored, k = 1 / s, all lanes at once (IEEE division and rounding per lane, so the same
// bits as one block at a time).
template <int S> static inline BlockScales block_scales(void *scales, int64_t b0, int n, vu8 peaks, const Grid &g) {
  const vf8 raw = (vi8)peaks >= (vi8)bcu8(0x7F800000u) ? bc8(__builtin_nanf("")) : (vf8)peaks / bc8(g.q);
  vf8 s = raw;
  if constexpr (S == SCALE_F32) {
    memcpy((float *)scales + b0, &s, sizeof(float) * n);
  } else {
    vu8 bits;  // the stored 16-bit patterns
    if constexpr (S == SCALE_BF16) {
      bits = raw != raw ? bcu8(0x7FC0u) : ((vu8)raw + 0xFFFFu) >> 16;
    } else {
      const __m128i nearest = _mm256_cvtps_ph((__m256)raw, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      // positive values: the next one up has bits + 1
      bits = (vu8)_mm256_cvtepu16_epi32(nearest) + ((vu8)((vf8)_mm256_cvtph_ps(nearest) < raw) & 1u);
    }
    alignas(16) uint16_t stored[8];
    _mm_store_si128((__m128i *)stored, _mm_packus_epi32(_mm256_castsi256_si128((__m256i)bits),
                                                        _mm256_extracti128_si256((__m256i)bits, 1)));
    memcpy((uint16_t *)scales + b0, stored, sizeof(uint16_t) * n);
    s = S == SCALE_BF16 ? (vf8)(bits << 16) : (vf8)_mm256_cvtph_ps(_mm_load_si128((const __m128i *)stored));
  }
  const vf8 k = bc8(1.0f) / s, k16 = k * bc8(65536.0f);
  const vi8 finite_k = (vf8)((vu8)k & 0x7FFFFFFFu) <= bc8(FLT_MAX);
  const vi8 fixed = (s > bc8(0.0f)) & (k16 <= bc8(FLT_MAX));
  return BlockScales{s, k, k16, _mm256_movemask_ps((__m256)~finite_k), _mm256_movemask_ps((__m256)fixed)};
}

// The codes of the LANES values t of a block (any lane order; ``noise``: their 16 random bits when SR) as
// int32 lanes: the signed code of int8, the code of uint8 / uint4 (1..Q), the byte of fp8.
// FIXED: the block's ``fixed`` holds (integer codes, and fp8 codes rounded stochastically).
template <int KIND, bool SR, bool FIXED>
static inline vi code_lanes(vf t, const BlockScale &b, const Grid &g, vu noise) {
  const vf abs_mask = (vf)bcu(0x7FFFFFFFu);
  // y = t * k (integer codes' fixed path: t itself, k * 2^16 comes below); finite in a fixed block
  const vf y = FIXED ? (fp8_kind<KIND>() ? t * b.k : t) : [&] {
    const vf v = b.divide ? t / b.s : t * b.k;
    return select((vi)((vf)((vu)v & (vu)abs_mask) <= bc(FLT_MAX)), v, bc(0.0f));  // 0 / 0, x / 0, NaN blocks
  }();
  // |y|; the fixed path of unsigned codes skips it: there t >= 0 or -0, whose code is the same
  const vf a = FIXED && unsigned_kind<KIND>() ? y : (vf)((vu)y & (vu)abs_mask);
  if constexpr (!fp8_kind<KIND>()) {
    vi m;
    if constexpr (SR) {
      const vf scaled = FIXED ? a * b.k16 : a * bc(65536.0f);  // c * 2^16
      m = (vi)(((vu)truncate_(scaled) + noise) >> 16);
    } else {
      const vf c = FIXED ? a * b.k : a;
      m = truncate_(round_even_(c));
    }
    m = m < g.top_code ? m : g.top_code;
    if constexpr (unsigned_kind<KIND>()) return m > g.least_code ? m : g.least_code;
    else return (vi)y < 0 ? -m : m;  // y's sign (m is 0 where y is +-0)
  } else {
    if constexpr (FIXED) {
      // Stochastic rounding in the bits. For a normal a = 2^e (1 + f 2^-23): F = floor(c 2^16) = 2^(m+16)
      // + f >> (7 - m), so (F + r) >> 16 = 2^m + ((f >> (7 - m)) + r) >> 16, and the byte of q =
      // ((F + r) >> 16) * 2^(e-m) is (e + bias) << m plus that minus 2^m (a carry out of the
      // mantissa moves q to the next binade, as the byte's own carry does): ((bits(a) >> (7 - m)) +
      // r) >> 16 minus the exponent bias difference. A subnormal a's byte is (F + r) >> 16.
      // Both are (F' + r) >> 16 for one F' (the normal one less the bias times 2^16, still >= 2^19),
      // so the bits are added once, after the clamp: F' >= top * 2^16 gives top whatever r < 2^16,
      // and F' < top * 2^16 gives at most top, as clamping the byte would.
      static_assert(SR, "the fixed path of fp8 codes rounds stochastically");
      const vu normal = ((vu)a >> g.fixed_shift) - g.fixed_bias;
      const vu subnormal = (vu)truncate_(a * g.sub_fixed);
      const vi either = (vi)((a < g.min_binade) ? subnormal : normal);  // below 2^31
      const vu fixed = (vu)(either < (vi)g.top_fixed ? either : (vi)g.top_fixed);
      return (vi)(((fixed + noise) >> 16) | (((vu)y >> 24) & 0x80u));
    }
    const vf binade = (vf)((vu)a & 0x7F800000u);
    const vf spacing = select((vi)(binade > g.min_binade), binade, g.min_binade) * g.inv_mantissa;
    vi m;
    if constexpr (SR) {
      const vf scaled = a * (vf)(bcu(270u << 23) - (vu)spacing);  // a / spacing * 2^16, exactly
      m = (vi)(((vu)truncate_(scaled) + noise) >> 16);
    } else {
      const vf c = a * (vf)(bcu(254u << 23) - (vu)spacing);  // a / spacing, exactly
      m = truncate_(round_even_(c));
    }
    vf q = int_to_float((vu)m) * spacing;
    q = select((vi)(q < g.least), g.least, q);
    q = select((vi)(q > g.top), g.top, q);
    const vu bits = (vu)q;  // q >= 0
    const vu normal = (bits >> g.normal_shift) - g.normal_bias;
    const vu subnormal = (vu)truncate_(q * g.sub_scale);
    return (vi)(((q < g.min_binade) ? subnormal : normal) | (((vu)y >> 24) & 0x80u));
  }
}

// ---- codes in memory order: 8 at a time (the codec), 2 * LANES as (even, odd) lanes (the step) ----
// The 8 lanes of ``v`` (code_lanes) as bytes: the low 8 bits of each.
static inline __m128i low_bytes(vi8 v) {
  const __m256i b = _mm256_and_si256((__m256i)v, _mm256_set1_epi32(0xFF));
  const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
  return _mm_packus_epi16(_mm_packus_epi32(lo, hi), lo);  // 8 bytes in the low half
}

// store8 of every one-byte code: the low byte of each lane.
static inline void store8_bytes(void *codes, int64_t j, vi8 v) {
  _mm_storel_epi64((__m128i *)((uint8_t *)codes + j), low_bytes(v));
}

// store_lanes of every one-byte code: byte 2l from even lane l, byte 2l + 1 from odd lane l (the
// low bytes of the 16-bit lanes even | odd << 8).
static inline void store_lanes_bytes(void *codes, int64_t i, vi even, vi odd) {
  const vh pairs = low_halves((vu)(even & 0xFF) | ((vu)odd << 8));
  memcpy((uint8_t *)codes + i, &pairs, sizeof(vh));
}

// The 2 * LANES bytes from ``i`` as LANES 16-bit lanes (lane l: byte 2l | byte 2l+1 << 8).
static inline vh byte_pairs(const void *codes, int64_t i) {
  vh pairs;
  memcpy(&pairs, (const uint8_t *)codes + i, sizeof(vh));
  return pairs;
}

// One-byte integer codes (int8, uint8): loads sign- or zero-extend the byte.
template <bool SIGNED_BYTES> struct IntegerBytes {
  static inline vf8 load8(const void *codes, int64_t j) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)codes + j));
    return (vf8)_mm256_cvtepi32_ps(SIGNED_BYTES ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  }
  static inline void store8(void *codes, int64_t j, vi8 v) { store8_bytes(codes, j, v); }
  static inline void load_lanes(const void *codes, int64_t i, vf &even, vf &odd) {
    if constexpr (SIGNED_BYTES) {
      // lane l: byte 2l | byte 2l+1 << 8, sign-extended from the odd byte
      const vi sx = widen((vhs)byte_pairs(codes, i));
      even = int_to_float((vu)((sx << 24) >> 24));
      odd = int_to_float((vu)(sx >> 8));
    } else {
      const vu x = widen(byte_pairs(codes, i));
      even = int_to_float(x & 0xFFu);
      odd = int_to_float(x >> 8);
    }
  }
  static inline void store_lanes(void *codes, int64_t i, vi even, vi odd) { store_lanes_bytes(codes, i, even, odd); }
};

// One-byte fp8 codes: VALUES gives the fp32 values of LANES codes held in the high bytes of 16-bit lanes.
template <vf (*VALUES)(vh)> struct Fp8Bytes {
#if LOWP_LANES == 8  // the codec's (codes.cpp); VALUES takes 8 lanes only there
  static inline vf8 load8(const void *codes, int64_t j) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)codes + j));
    return VALUES((vh)_mm_unpacklo_epi8(_mm_setzero_si128(), b));  // code k: the high byte of lane k
  }
#endif
  static inline void store8(void *codes, int64_t j, vi8 v) { store8_bytes(codes, j, v); }
  static inline void load_lanes(const void *codes, int64_t i, vf &even, vf &odd) {
    const vh pairs = byte_pairs(codes, i);
    even = VALUES(pairs << 8);
    odd = VALUES(pairs);
  }
  static inline void store_lanes(void *codes, int64_t i, vi even, vi odd) { store_lanes_bytes(codes, i, even, odd); }
};

// 4-bit codes, two per byte, element 2k in the low nibble of byte k; a signed code is a two's
// complement nibble (loads sign-extend it, stores keep its low 4 bits).
template <bool SIGNED_NIBBLES> struct Nibbles {
  template <typename V> static inline V extend(V nibbles) { return SIGNED_NIBBLES ? (nibbles << 28) >> 28 : nibbles; }
  static inline vf8 load8(const void *codes, int64_t j) {  // j even: the 4 bytes from j / 2
    uint32_t w;
    memcpy(&w, (const uint8_t *)codes + j / 2, 4);
    __m256i b = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128((int)w));  // byte k in 64-bit lane k
    __m256i lo = _mm256_and_si256(b, _mm256_set1_epi64x(0xF));
    __m256i hi = _mm256_and_si256(_mm256_slli_epi64(b, 28), _mm256_set1_epi64x(0xF00000000ll));
    return (vf8)_mm256_cvtepi32_ps((__m256i)extend((vi8)_mm256_or_si256(lo, hi)));
  }
  static inline void store8(void *codes, int64_t j, vi8 v) {
    // byte k = nibble 2k | nibble (2k + 1) << 4, in the low byte of 64-bit lane k
    uint8_t *p = (uint8_t *)codes;
    const __m256i n = (__m256i)(v & 15);
    __m256i pairs = _mm256_or_si256(n, _mm256_srli_epi64(n, 28));
    __m256i picked = _mm256_shuffle_epi8(pairs, _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                 -1, -1, 0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                 -1, -1, -1, -1));
    uint16_t a = (uint16_t)_mm_extract_epi16(_mm256_castsi256_si128(picked), 0);
    uint16_t b = (uint16_t)_mm_extract_epi16(_mm256_extracti128_si256(picked, 1), 0);
    memcpy(p + j / 2, &a, 2);
    memcpy(p + j / 2 + 2, &b, 2);
  }
  static inline void load_lanes(const void *codes, int64_t i, vf &even, vf &odd) {
    const uint8_t *p = (const uint8_t *)codes + i / 2;  // lane l: byte l, elements 2l (low nibble) and 2l + 1
#if LOWP_LANES == 16
    const vi x = (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    const vi x = (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#endif
    even = int_to_float((vu)extend(x & 15));
    odd = int_to_float((vu)extend(x >> 4));
  }
  static inline void store_lanes(void *codes, int64_t i, vi even, vi odd) {
    uint8_t *p = (uint8_t *)codes + i / 2;  // byte l = nibble 2l | nibble (2l + 1) << 4
    const vi bytes = (even & 15) | ((odd & 15) << 4);
#if LOWP_LANES == 16
    _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8((__m512i)bytes));
#else
    // the low byte of each 32-bit lane, gathered
    const __m256i b = _mm256_shuffle_epi8((__m256i)bytes,
                                          _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                           0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    _mm_storel_epi64((__m128i *)p, _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0))));
#endif
  }
};
