// int4 codes (lowp/optim/encodings/int4.py): two per byte, element 2k in the low nibble of byte k,
// each a two's complement nibble (-7..7).
constexpr int CODE_INT4 = 5;
template <> struct Storage<CODE_INT4> : Nibbles<true> {
  static constexpr int BITS = 4;
  static constexpr bool SIGNED = true, FP8 = false;
};
