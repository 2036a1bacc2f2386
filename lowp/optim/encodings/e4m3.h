// e4m3 codes (lowp/optim/encodings/e4m3.py): one fp8 e4m3fn byte each.
//
// The fp32 values of LANES codes, each the high byte of a 16-bit lane of ``x`` (the low bytes are
// ignored), bit for bit as torch's casts, through the fp16 pattern of each code and the hardware's
// exact fp16 -> fp32 conversion (F16C, AVX-512F). A code s.eeee.mmm is the fp16 s.0eeee.mmm0000000
// (an arithmetic shift right by one, the sign copied into the cleared bit 14) times 2^-8, normal and
// subnormal codes alike; its NaN s.1111.111 is the one code whose bits 7..13 are all ones there,
// and adding 0x80 to them carries into bit 14, which makes it the fp16 NaN s.11111.1110000000
// (fp32 0x7FF00000 | s, torch's NaN).
static inline vf e4m3_values(vh x) {
  const vh h = (vh)((vhs)x >> 1) & 0xBF80;
  const vh nan = ((h & 0x3F80) + 0x80) & 0x4000;
  return f16_to_f32((half_vector)(h | nan)) * bc(256.0f);
}

constexpr int CODE_E4M3 = 3;
template <> struct Storage<CODE_E4M3> : Fp8Bytes<e4m3_values> {
  static constexpr int BITS = 8;
  static constexpr bool SIGNED = true, FP8 = true;
};
