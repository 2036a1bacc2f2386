// int8 codes (lowp/optim/encodings/int8.py): one signed byte each.
constexpr int CODE_INT8 = 0;
template <> struct Storage<CODE_INT8> : IntegerBytes<true> {
  static constexpr int BITS = 8;
  static constexpr bool SIGNED = true, FP8 = false;
};
