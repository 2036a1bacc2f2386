// e5m2 codes (lowp/optim/encodings/e5m2.py): one fp8 byte each.
constexpr int CODE_E5M2 = 4;
template <> struct Storage<CODE_E5M2> {
  static constexpr int BITS = 8;
  static constexpr bool SIGNED = true, FP8 = true;
  // The fp32 values of 8 codes, each the high byte of a 16-bit lane of ``x`` (the low bytes are
  // ignored), bit for bit as torch's casts: an e5m2 code is the top byte of an fp16, whose exact
  // conversion (F16C; subnormals never flushed) quiets a signalling NaN (0x7D00 -> 0x7FE00000) as torch does.
  static inline vf values(__m128i x) { return (vf)_mm256_cvtph_ps(_mm_and_si128(x, _mm_set1_epi16((short)0xFF00))); }
  static inline vf load8(const void *codes, int64_t j) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)codes + j));
    return values(_mm_unpacklo_epi8(_mm_setzero_si128(), b));  // code k: the high byte of lane k
  }
  static inline void store8(void *codes, int64_t j, vi v) { store8_bytes(codes, j, v); }
  static inline void load16(const void *codes, int64_t i, vf &even, vf &odd) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)((const uint8_t *)codes + i));
    even = values(_mm_slli_epi16(bytes, 8));
    odd = values(bytes);
  }
  static inline void store16(void *codes, int64_t i, vi even, vi odd) { store16_bytes(codes, i, even, odd); }
};
