// int4 codes (lowp/optim/encodings/int4.py): two per byte, element 2k in the low nibble of byte k,
// each a two's complement nibble (-7..7).
constexpr int CODE_INT4 = 5;
template <> struct Storage<CODE_INT4> {
  static constexpr int BITS = 4;
  static constexpr bool SIGNED = true, FP8 = false;
  static inline vf load8(const void *codes, int64_t j) {  // j even: the 4 bytes from j / 2
    uint32_t w;
    memcpy(&w, (const uint8_t *)codes + j / 2, 4);
    __m256i b = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128((int)w));  // byte k in 64-bit lane k
    __m256i lo = _mm256_and_si256(b, _mm256_set1_epi64x(0xF));
    __m256i hi = _mm256_and_si256(_mm256_slli_epi64(b, 28), _mm256_set1_epi64x(0xF00000000ll));
    const vi nibbles = (vi)_mm256_or_si256(lo, hi);
    return (vf)_mm256_cvtepi32_ps((__m256i)((nibbles << 28) >> 28));  // sign-extended
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
    even = (vf)_mm256_cvtepi32_ps((__m256i)((x << 28) >> 28));  // lane l: byte l's low nibble, sign-extended
    odd = (vf)_mm256_cvtepi32_ps((__m256i)((x << 24) >> 28));
  }
  static inline void store16(void *codes, int64_t i, vi even, vi odd) {
    const __m256i b = _mm256_shuffle_epi8((__m256i)((even & 15) | ((odd & 15) << 4)),
                                          _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                           0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    _mm_storel_epi64((__m128i *)((uint8_t *)codes + i / 2),
                     _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0))));
  }
};
