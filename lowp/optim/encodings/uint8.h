// uint8 codes (lowp/optim/encodings/uint8.py): one unsigned byte each, the square root's code.
constexpr int CODE_UINT8 = 1;
template <> struct Storage<CODE_UINT8> : IntegerBytes<false> {
  static constexpr int BITS = 8;
  static constexpr bool SIGNED = false, FP8 = false;
};
