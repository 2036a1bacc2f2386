// nearest write-back (lowp/optim/writeback/nearest.py): theta' = rn(theta + u).
static inline void load_weight(const Pointers &p, int64_t i, vf w[2]) { load<WT>(p.w, i, w[0], w[1]); }

static inline void write_back_lanes(const Pointers &p, int64_t i, const Rng &rng, const vf w[2], const vf u[2],
                                    vi still[2]) {
  (void)rng;
  vf neww[2];
  for (int h = 0; h < 2; h++) {
    neww[h] = round_to<WT>(w[h] + u[h]);
    still[h] = neww[h] == w[h];
  }
  store<WT>(p.w, i, neww[0], neww[1]);
}
