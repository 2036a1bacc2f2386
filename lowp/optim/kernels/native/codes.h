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
//     as fp32 values / from code_lanes' int32 lanes;
//   load16(codes, i, even, odd) / store16(codes, i, even, odd): the 16 elements from i (a multiple
//     of 16) as (even, odd) lanes, as coded_step.h holds them.
template <int KIND> struct Storage;
// byte offset of element ``i``'s code
template <int KIND> static inline int64_t code_offset(int64_t i) { return Storage<KIND>::BITS == 4 ? i / 2 : i; }
// bytes of ``n`` codes
template <int KIND> static inline int64_t code_bytes(int64_t n) { return Storage<KIND>::BITS == 4 ? (n + 1) / 2 : n; }
constexpr int MAX_BLOCK = 256;

// The grid of one code (lowp.optim.codes.Code), broadcast once per call.
struct Grid {
  vf top, least;             // Q, and L: 0 for signed codes, 1 for unsigned ones (which never hold 0)
  vf min_binade, inv_mantissa, sub_scale;
  vi top_code, least_code;  // Q and L as integers (integer codes)
  vf sub_fixed;              // fp8 subnormals: 2^(m - emin + 16), c * 2^16 of the fixed path
  vu normal_shift, normal_bias, fixed_shift;
  vu fixed_bias, top_fixed;  // fp8's fixed path: normal_bias and the byte of Q, times 2^16

  Grid(int is_signed, float q, int m, int emin) {
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

// ---- random bits of the elements of a block ------------------------------------------------------
// Stochastic rounding draws random16(i, key) for global element index i = first + j (the element's
// index in its whole parameter: lowp.optim.randomness), or reads bits the caller drew.
struct CountedNoise {
  uint64_t first;
  uint32_t key;
  FoldedKeys<1> folded;

  // the bits of elements j .. j + 7
  inline vu at(int64_t j) {
    const uint64_t g = first + (uint64_t)j;
    folded.fold(&key, g);
    const uint32_t lo = (uint32_t)g;
    const vu lanes = (vu){0, 1, 2, 3, 4, 5, 6, 7} + lo;
    if (__builtin_expect(lo <= 0xFFFFFFF8u, 1)) return random16(lanes ^ bcu(folded.k0[0]));
    return random16(lanes ^ folded.wrapped(0, lanes, lo));
  }
  // the noise of a block of ``n`` elements padded to a multiple of 8 (the bits are computed: no read)
  inline CountedNoise &padded(int64_t, int32_t *) { return *this; }
};

struct DrawnNoise {
  const int32_t *bits;
  inline vu at(int64_t j) const {
    vu v;
    memcpy(&v, bits + j, 32);
    return v;
  }
  // the bits of a block of ``n`` elements padded to a multiple of 8: copied into ``local``
  inline DrawnNoise padded(int64_t n, int32_t *local) const {
    memset(local, 0, sizeof(int32_t) * MAX_BLOCK);
    memcpy(local, bits, sizeof(int32_t) * n);
    return DrawnNoise{local};
  }
};

// ---- the scales of up to 8 blocks, and the codes of 8 values of a block -------------------------
// |t| as bits, whose unsigned maximum over a block is the bits of max |t| (NaN and infinity above
// every finite value): the block's peak, one integer max per 8 values.
static inline vu peak_of(vu peak, vf t) { return (vu)_mm256_max_epu32((__m256i)peak, (__m256i)((vu)t & 0x7FFFFFFFu)); }

// Lane b: the largest lane of v[b] (unsigned), for 8 vectors at once: a tree of shuffles as
// _mm256_hadd_ps sums 8 vectors, with max in place of the sum.
static inline vu lane_maxima(const vu v[8]) {
  // lanes a0|a1, a2|a3, b0|b1, b2|b3 of each 128-bit half (| is max)
  auto pairs = [](vu a, vu b) {
    return (vu)_mm256_max_epu32((__m256i)_mm256_shuffle_ps((__m256)a, (__m256)b, 0x88),
                                (__m256i)_mm256_shuffle_ps((__m256)a, (__m256)b, 0xDD));
  };
  const vu low = pairs(pairs(v[0], v[1]), pairs(v[2], v[3]));   // half h, lane j: half h of v[j]
  const vu high = pairs(pairs(v[4], v[5]), pairs(v[6], v[7]));  // the same for v[4 + j]
  return (vu)_mm256_max_epu32(_mm256_permute2x128_si256((__m256i)low, (__m256i)high, 0x20),
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
  vf s, k, k16;
  int divide, fixed;
  inline BlockScale operator[](int b) const {
    return BlockScale{bc(s[b]), bc(k[b]), bc(k16[b]), ((divide >> b) & 1) != 0, ((fixed >> b) & 1) != 0};
  }
};

// The scales of the ``n`` (<= 8) blocks from ``b0`` on, from the bits of their peaks |t| (lane b:
// block b0 + b; >= 0x7F800000: a NaN or an infinity, whose scale is NaN): s = peak / Q rounded up
// to S and stored, k = 1 / s, all lanes at once (IEEE division and rounding per lane, so the same
// bits as one block at a time).
template <int S> static inline BlockScales block_scales(void *scales, int64_t b0, int n, vu peaks, const Grid &g) {
  const vf raw = select((vi)peaks >= (vi)bcu(0x7F800000u), bc(__builtin_nanf("")), (vf)peaks / g.top);
  vf s = raw;
  if constexpr (S == SCALE_F32) {
    memcpy((float *)scales + b0, &s, sizeof(float) * n);
  } else {
    vu bits;  // the stored 16-bit patterns
    if constexpr (S == SCALE_BF16) {
      bits = (vu)select(raw != raw, (vf)bcu(0x7FC0u), (vf)(((vu)raw + 0xFFFFu) >> 16));
    } else {
      const __m128i nearest = _mm256_cvtps_ph((__m256)raw, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      // positive values: the next one up has bits + 1
      bits = (vu)_mm256_cvtepu16_epi32(nearest) + ((vu)((vf)_mm256_cvtph_ps(nearest) < raw) & 1u);
    }
    alignas(16) uint16_t stored[8];
    _mm_store_si128((__m128i *)stored, _mm_packus_epi32(_mm256_castsi256_si128((__m256i)bits),
                                                        _mm256_extracti128_si256((__m256i)bits, 1)));
    memcpy((uint16_t *)scales + b0, stored, sizeof(uint16_t) * n);
    s = S == SCALE_BF16 ? (vf)(bits << 16) : (vf)_mm256_cvtph_ps(_mm_load_si128((const __m128i *)stored));
  }
  const vf k = bc(1.0f) / s, k16 = k * bc(65536.0f);
  const vi finite_k = (vf)((vu)k & 0x7FFFFFFFu) <= bc(FLT_MAX);
  const vi fixed = (s > bc(0.0f)) & (k16 <= bc(FLT_MAX));
  return BlockScales{s, k, k16, _mm256_movemask_ps((__m256)~finite_k), _mm256_movemask_ps((__m256)fixed)};
}

// The codes of 8 values t of a block (any lane order; ``noise``: their 16 random bits when SR) as
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
      m = (vi)(((vu)_mm256_cvttps_epi32((__m256)scaled) + noise) >> 16);
    } else {
      const vf c = FIXED ? a * b.k : a;
      m = (vi)_mm256_cvttps_epi32(_mm256_round_ps((__m256)c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    m = (vi)_mm256_min_epi32((__m256i)m, (__m256i)g.top_code);
    if constexpr (unsigned_kind<KIND>()) return (vi)_mm256_max_epi32((__m256i)m, (__m256i)g.least_code);
    else return (vi)_mm256_sign_epi32((__m256i)m, (__m256i)y);  // y's sign; -0 and +0 give 0
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
      const vu subnormal = (vu)_mm256_cvttps_epi32((__m256)(a * g.sub_fixed));
      const vu fixed = (vu)_mm256_min_epi32((__m256i)((a < g.min_binade) ? subnormal : normal), (__m256i)g.top_fixed);
      return (vi)(((fixed + noise) >> 16) | (((vu)y >> 24) & 0x80u));
    }
    const vf binade = (vf)((vu)a & 0x7F800000u);
    const vf spacing = select((vi)(binade > g.min_binade), binade, g.min_binade) * g.inv_mantissa;
    vi m;
    if constexpr (SR) {
      const vf scaled = a * (vf)(bcu(270u << 23) - (vu)spacing);  // a / spacing * 2^16, exactly
      m = (vi)(((vu)_mm256_cvttps_epi32((__m256)scaled) + noise) >> 16);
    } else {
      const vf c = a * (vf)(bcu(254u << 23) - (vu)spacing);  // a / spacing, exactly
      m = (vi)_mm256_cvttps_epi32(_mm256_round_ps((__m256)c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    vf q = (vf)_mm256_cvtepi32_ps((__m256i)m) * spacing;
    q = select((vi)(q < g.least), g.least, q);
    q = select((vi)(q > g.top), g.top, q);
    const vu bits = (vu)q;  // q >= 0
    const vu normal = (bits >> g.normal_shift) - g.normal_bias;
    const vu subnormal = (vu)_mm256_cvttps_epi32((__m256)(q * g.sub_scale));
    return (vi)(((q < g.min_binade) ? subnormal : normal) | (((vu)y >> 24) & 0x80u));
  }
}

// ---- 8 codes at a time, in memory order ----------------------------------------------------------
// The 8 lanes of ``v`` (code_lanes) as bytes: the low 8 bits of each.
static inline __m128i low_bytes(vi v) {
  const __m256i b = _mm256_and_si256((__m256i)v, _mm256_set1_epi32(0xFF));
  const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
  return _mm_packus_epi16(_mm_packus_epi32(lo, hi), lo);  // 8 bytes in the low half
}

// store8 of every one-byte code: the low byte of each lane.
static inline void store8_bytes(void *codes, int64_t j, vi v) {
  _mm_storel_epi64((__m128i *)((uint8_t *)codes + j), low_bytes(v));
}

// store16 of every one-byte code: 16-bit lanes e0-3 o0-3 | e4-7 o4-7 (codes fit without
// saturating), their low bytes interleaved within each half, the halves' low 8 bytes joined.
static inline void store16_bytes(void *codes, int64_t i, vi even, vi odd) {
  const __m256i w = _mm256_packs_epi32((__m256i)even, (__m256i)odd);
  const __m256i b = _mm256_shuffle_epi8(w, _mm256_setr_epi8(0, 8, 2, 10, 4, 12, 6, 14, -1, -1, -1, -1, -1, -1, -1, -1,
                                                            0, 8, 2, 10, 4, 12, 6, 14, -1, -1, -1, -1, -1, -1, -1, -1));
  _mm_storeu_si128((__m128i *)((uint8_t *)codes + i), _mm256_castsi256_si128(_mm256_permute4x64_epi64(b, 0x08)));
}

// One-byte integer codes (int8, uint8): loads sign- or zero-extend the byte.
template <bool SIGNED_BYTES> struct IntegerBytes {
  static inline vf load8(const void *codes, int64_t j) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)codes + j));
    return (vf)_mm256_cvtepi32_ps(SIGNED_BYTES ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  }
  static inline void store8(void *codes, int64_t j, vi v) { store8_bytes(codes, j, v); }
  static inline void load16(const void *codes, int64_t i, vf &even, vf &odd) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)((const uint8_t *)codes + i));
    if constexpr (SIGNED_BYTES) {
      const vi sx = (vi)_mm256_cvtepi16_epi32(bytes);  // lane l: byte 2l | byte 2l+1 << 8, sign-extended from the odd byte
      even = (vf)_mm256_cvtepi32_ps((__m256i)((sx << 24) >> 24));
      odd = (vf)_mm256_cvtepi32_ps((__m256i)(sx >> 8));
    } else {
      const vu x = (vu)_mm256_cvtepu16_epi32(bytes);  // lane l: byte 2l | byte 2l+1 << 8
      even = (vf)_mm256_cvtepi32_ps((__m256i)(x & 0xFFu));
      odd = (vf)_mm256_cvtepi32_ps((__m256i)(x >> 8));
    }
  }
  static inline void store16(void *codes, int64_t i, vi even, vi odd) { store16_bytes(codes, i, even, odd); }
};

// One-byte fp8 codes: VALUES gives the fp32 values of 8 codes held in the high bytes of 16-bit lanes.
template <vf (*VALUES)(__m128i)> struct Fp8Bytes {
  static inline vf load8(const void *codes, int64_t j) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)codes + j));
    return VALUES(_mm_unpacklo_epi8(_mm_setzero_si128(), b));  // code k: the high byte of lane k
  }
  static inline void store8(void *codes, int64_t j, vi v) { store8_bytes(codes, j, v); }
  static inline void load16(const void *codes, int64_t i, vf &even, vf &odd) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)((const uint8_t *)codes + i));
    even = VALUES(_mm_slli_epi16(bytes, 8));
    odd = VALUES(bytes);
  }
  static inline void store16(void *codes, int64_t i, vi even, vi odd) { store16_bytes(codes, i, even, odd); }
};

// 4-bit codes, two per byte, element 2k in the low nibble of byte k; a signed code is a two's
// complement nibble (loads sign-extend it, stores keep its low 4 bits).
template <bool SIGNED_NIBBLES> struct Nibbles {
  static inline vi extend(vi nibbles) { return SIGNED_NIBBLES ? (nibbles << 28) >> 28 : nibbles; }
  static inline vf load8(const void *codes, int64_t j) {  // j even: the 4 bytes from j / 2
    uint32_t w;
    memcpy(&w, (const uint8_t *)codes + j / 2, 4);
    __m256i b = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128((int)w));  // byte k in 64-bit lane k
    __m256i lo = _mm256_and_si256(b, _mm256_set1_epi64x(0xF));
    __m256i hi = _mm256_and_si256(_mm256_slli_epi64(b, 28), _mm256_set1_epi64x(0xF00000000ll));
    return (vf)_mm256_cvtepi32_ps((__m256i)extend((vi)_mm256_or_si256(lo, hi)));
  }
  static inline void store8(void *codes, int64_t j, vi v) {
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
  static inline void load16(const void *codes, int64_t i, vf &even, vf &odd) {
    const vi x = (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((const uint8_t *)codes + i / 2)));
    even = (vf)_mm256_cvtepi32_ps((__m256i)extend(x & 15));  // lane l: byte l
    odd = (vf)_mm256_cvtepi32_ps((__m256i)extend((vi)((vu)x >> 4)));
  }
  static inline void store16(void *codes, int64_t i, vi even, vi odd) {
    // byte l = nibble 2l | nibble (2l + 1) << 4: the low byte of each 32-bit lane, gathered
    const __m256i b = _mm256_shuffle_epi8((__m256i)((even & 15) | ((odd & 15) << 4)),
                                          _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                           0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    _mm_storel_epi64((__m128i *)((uint8_t *)codes + i / 2),
                     _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0))));
  }
};

// ---- one block ---------------------------------------------------------------------------------
// The codes of the ``n`` values t (a multiple of 8) of a block whose scale is ``bs``.
template <int KIND, bool SR, bool FIXED, typename Noise>
static inline void encode_values(const float *t, int64_t n, void *codes, const BlockScale &bs, const Grid &g,
                                 Noise &noise) {
  for (int64_t j = 0; j < n; j += 8) {
    vf v;
    memcpy(&v, t + j, 32);
    Storage<KIND>::store8(codes, j, code_lanes<KIND, SR, FIXED>(v, bs, g, SR ? noise.at(j) : vu{}));
  }
}

// Encode ``n`` values (a multiple of 8, at most MAX_BLOCK) from ``x`` into the codes from
// ``codes`` (byte offset of element 0 of the block) and scale ``b``.
template <int KIND, int S, bool SR, typename Noise>
static inline void encode_block(const float *x, int64_t n, void *codes, void *scales, int64_t b, const Grid &g,
                                Noise &noise) {
  alignas(32) float roots[MAX_BLOCK];
  const float *t = x;
  vu peak = {};
  for (int64_t j = 0; j < n; j += 8) {
    vf v;
    memcpy(&v, x + j, 32);
    if constexpr (unsigned_kind<KIND>()) {
      v = sqrt_(v);
      memcpy(roots + j, &v, 32);
    }
    peak = peak_of(peak, v);
  }
  if constexpr (unsigned_kind<KIND>()) t = roots;
  const vu peaks[8] = {peak};
  const BlockScale bs = block_scales<S>(scales, b, 1, lane_maxima(peaks), g)[0];
  if (bs.fixed && (!fp8_kind<KIND>() || SR)) encode_values<KIND, SR, !fp8_kind<KIND>() || SR>(t, n, codes, bs, g, noise);
  else encode_values<KIND, SR, false>(t, n, codes, bs, g, noise);
}

// Decode ``n`` values (a multiple of 8) of scale ``b`` into ``out``.
template <int KIND, int S>
static inline void decode_block(const void *codes, int64_t n, const void *scales, int64_t b, float *out) {
  const vf s = bc(scale_at<S>(scales, b));
  for (int64_t j = 0; j < n; j += 8) {
    vf y = Storage<KIND>::load8(codes, j) * s;
    if constexpr (unsigned_kind<KIND>()) y = y * y;
    memcpy(out + j, &y, 32);
  }
}

// ---- a range of whole blocks ---------------------------------------------------------------------
// Elements [start, end) of a tensor (start at a block boundary; end at one or at the tensor's end),
// with ``values`` holding element ``start`` first, ``codes`` and ``scales`` the tensor's own. The
// tensor's last block may be short and need not hold a multiple of 8 elements: it goes through
// zero-padded local buffers (zeros do not change a block's maximum; an odd uint4 tail's unused
// high nibble is cleared to 0, as _pack4 pads). ``noise(i)``: the random bits of the block from
// element i (unused to nearest).
template <int KIND, int S, bool SR, typename NoiseAt>
static inline void encode_span(const float *values, int64_t start, int64_t end, void *codes, void *scales,
                               int64_t block, const Grid &g, NoiseAt noise) {
  uint8_t *c = (uint8_t *)codes;
  for (int64_t i = start; i < end; i += block) {
    const int64_t n = end - i < block ? end - i : block;
    auto bits = noise(i);
    if (n % 8 == 0) {
      encode_block<KIND, S, SR>(values + (i - start), n, c + code_offset<KIND>(i), scales, i / block, g, bits);
      continue;
    }
    alignas(32) float x[MAX_BLOCK] = {};
    alignas(32) int32_t local_bits[MAX_BLOCK];
    alignas(32) uint8_t out[MAX_BLOCK];
    memcpy(x, values + (i - start), sizeof(float) * n);
    auto &&tail_bits = bits.padded(n, local_bits);
    encode_block<KIND, S, SR>(x, (n + 7) / 8 * 8, out, scales, i / block, g, tail_bits);
    if (Storage<KIND>::BITS == 4 && n % 2) out[n / 2] &= 0x0F;  // the unused high nibble is 0, as pack4 pads
    memcpy(c + code_offset<KIND>(i), out, code_bytes<KIND>(n));
  }
}

// Decode elements [start, end) (as encode_span) into ``out`` (element ``start`` first).
template <int KIND, int S>
static inline void decode_span(const void *codes, const void *scales, int64_t start, int64_t end, int64_t block,
                               float *out) {
  const uint8_t *c = (const uint8_t *)codes;
  for (int64_t i = start; i < end; i += block) {
    const int64_t n = end - i < block ? end - i : block;
    if (n % 8 == 0) {
      decode_block<KIND, S>(c + code_offset<KIND>(i), n, scales, i / block, out + (i - start));
      continue;
    }
    alignas(32) uint8_t local[MAX_BLOCK] = {};
    alignas(32) float y[MAX_BLOCK];
    memcpy(local, c + code_offset<KIND>(i), code_bytes<KIND>(n));
    decode_block<KIND, S>(local, (n + 7) / 8 * 8, scales, i / block, y);
    memcpy(out + (i - start), y, sizeof(float) * n);
  }
}
