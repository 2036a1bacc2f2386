// e5m2 codes (lowp/optim/encodings/e5m2.py): one fp8 byte each.
//
// The fp32 values of LANES codes, each the high byte of a 16-bit lane of ``x`` (the low bytes are
// ignored), bit for bit as torch's casts: an e5m2 code is the top byte of an fp16, whose exact
// conversion (F16C, AVX-512F; subnormals never flushed) quiets a signalling NaN (0x7D00 ->
// 0x7FE00000) as torch does.
static inline vf e5m2_values(vh x) { return f16_to_f32((half_vector)(x & 0xFF00)); }

constexpr int CODE_E5M2 = 4;
template <> struct Storage<CODE_E5M2> : Fp8Bytes<e5m2_values> {
  static constexpr int BITS = 8;
  static constexpr bool SIGNED = true, FP8 = true;
};
