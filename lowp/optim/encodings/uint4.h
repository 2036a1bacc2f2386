// uint4 codes (lowp/optim/encodings/uint4.py): two per byte, element 2k in the low nibble of byte k.
constexpr int CODE_UINT4 = 2;
template <> struct Storage<CODE_UINT4> : Nibbles<false> {
  static constexpr int BITS = 4;
  static constexpr bool SIGNED = false, FP8 = false;
};
