// e5m2 codes (lowp/optim/encodings/e5m2.py): one fp8 byte each.
//
// The fp32 values of 8 codes, each the high byte of a 16-bit lane of ``x`` (the low bytes are
// ignored), bit for bit as torch's casts: an e5m2 code is the top byte of an fp16, whose exact
// conversion (F16C; subnormals never flushed) quiets a signalling NaN (0x7D00 -> 0x7FE00000) as torch does.
static inline vf e5m2_values(__m128i x) {
  return (vf)_mm256_cvtph_ps(_mm_and_si128(x, _mm_set1_epi16((short)0xFF00)));
}

constexpr int CODE_E5M2 = 4;
template <> struct Storage<CODE_E5M2> : Fp8Bytes<e5m2_values> {
  static constexpr int BITS = 8;
  static constexpr bool SIGNED = true, FP8 = true;
};
