// exact write-back (lowp/optim/writeback/exact.py): the bf16 weight and its int16 remainder are the
// fp32 weight bit for bit; hi = (b + 2^15) >> 16, lo = b - (hi << 16).
static_assert(WT == BF16 && BT == I16, "exact mode: bf16 weights and an int16 remainder");

static inline void load_weight(const Pointers &p, int64_t i, vf w[2]) {
  vu top, rem;
  memcpy(&top, (const uint16_t *)p.w + i, sizeof(vu));
  memcpy(&rem, (const uint16_t *)p.b + i, sizeof(vu));
  w[0] = (vf)((top << 16) + (vu)(((vi)rem << 16) >> 16));
  w[1] = (vf)((top & 0xFFFF0000u) + (vu)((vi)rem >> 16));
}

static inline void write_back_lanes(const Pointers &p, int64_t i, const Rng &rng, const vf w[2], const vf u[2],
                                    vi still[2]) {
  (void)rng;
  vi top[2], rem[2];
  for (int h = 0; h < 2; h++) {
    vi x = (vi)(w[h] + u[h]);
    top[h] = (x + 0x8000) >> 16;
    rem[h] = x - (top[h] << 16);
    still[h] = (vi){};
  }
  vu pw = ((vu)top[1] << 16) | ((vu)top[0] & 0xFFFFu), pr = ((vu)rem[1] << 16) | ((vu)rem[0] & 0xFFFFu);
  memcpy((uint16_t *)p.w + i, &pw, sizeof(vu));
  memcpy((uint16_t *)p.b + i, &pr, sizeof(vu));
}
