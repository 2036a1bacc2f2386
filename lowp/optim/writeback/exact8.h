// exact8 write-back (lowp/optim/writeback/exact8.py): the weight is (hi << 16) + (r8 << 8) with the
// int8 remainder r8 (16 bytes: element pairs read as 8 uint16, even byte low); the low 8 bits of the
// new value are rounded stochastically with the top 8 of the weight stream's 16 bits (NaN: the quiet
// bit instead), then split as in exact mode one byte lower.
static_assert(WT == BF16 && BT == I8, "exact8 mode: bf16 weights and an int8 remainder");

static inline void load_weight(const Pointers &p, int64_t i, vf w[2]) {
  vu top;
  memcpy(&top, (const uint16_t *)p.w + i, sizeof(vu));
  vh pairs;
  memcpy(&pairs, (const int8_t *)p.b + i, sizeof(vh));
  const vu rem = widen(pairs);  // odd byte << 8 | even byte
  w[0] = (vf)((top << 16) + (vu)((vi)(rem << 24) >> 16));
  w[1] = (vf)((top & 0xFFFF0000u) + ((vu)((vi)(rem << 16) >> 16) & ~0xFFu));
}

static inline void write_back_lanes(const Pointers &p, int64_t i, const Rng &rng, const vf w[2], const vf u[2],
                                    vi still[2]) {
  vi top[2], rem[2];
  vu noise[2];
  rng.template bits<WEIGHT_STREAM>(noise);
  for (int h = 0; h < 2; h++) {
    const vf sum = w[h] + u[h];
    const vu x = (vu)sum;  // unsigned: the carries wrap as the int32 arithmetic of the reference
    const vu b2 = ((sum != sum) ? (x | 0x00400000u) : x + (noise[h] >> 8)) & ~0xFFu;
    top[h] = (vi)(b2 + 0x8000u) >> 16;
    rem[h] = (vi)(b2 - ((vu)top[h] << 16)) >> 8;
    still[h] = (vi)(b2 == (vu)w[h]);
  }
  vu pw = ((vu)top[1] << 16) | ((vu)top[0] & 0xFFFFu);
  vh pr = low_halves(((vu)rem[1] << 8) | ((vu)rem[0] & 0xFFu));
  memcpy((uint16_t *)p.w + i, &pw, sizeof(vu));
  memcpy((int8_t *)p.b + i, &pr, sizeof(vh));
}
