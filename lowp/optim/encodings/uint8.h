// uint8 codes (lowp/optim/encodings/uint8.py): one unsigned byte each, the square root's code.
constexpr int CODE_UINT8 = 1;
template <> struct Storage<CODE_UINT8> {
  static constexpr int BITS = 8;
  static constexpr bool SIGNED = false, FP8 = false;
  static inline vf load8(const void *codes, int64_t j) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)codes + j));
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
  }
  static inline void store8(void *codes, int64_t j, vi v) { store8_bytes(codes, j, v); }
  static inline void load16(const void *codes, int64_t i, vf &even, vf &odd) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)((const uint8_t *)codes + i));
    const vu x = (vu)_mm256_cvtepu16_epi32(bytes);  // lane l: byte 2l | byte 2l+1 << 8
    even = (vf)_mm256_cvtepi32_ps((__m256i)(x & 0xFFu));
    odd = (vf)_mm256_cvtepi32_ps((__m256i)(x >> 8));
  }
  static inline void store16(void *codes, int64_t i, vi even, vi odd) { store16_bytes(codes, i, even, odd); }
};
