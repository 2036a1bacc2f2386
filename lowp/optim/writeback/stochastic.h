// stochastic write-back (lowp/optim/writeback/stochastic.py): theta' = SR(theta + u), weight stream.
static_assert(WT == BF16 || WT == F16, "stochastic write-back: bf16 or fp16 weights");

static inline void load_weight(const Pointers &p, int64_t i, vf w[2]) { load<WT>(p.w, i, w[0], w[1]); }

static inline void write_back_lanes(const Pointers &p, int64_t i, const Rng &rng, const vf w[2], const vf u[2],
                                    vi still[2]) {
  vf neww[2];
  vu noise[2];
  rng.template bits<WEIGHT_STREAM>(noise);
  for (int h = 0; h < 2; h++) {
    neww[h] = stochastic_to<WT>(w[h] + u[h], noise[h]);
    still[h] = neww[h] == w[h];
  }
  store<WT>(p.w, i, neww[0], neww[1]);
}
