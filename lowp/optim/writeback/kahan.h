// kahan write-back (lowp/optim/writeback/kahan.py): v = k + u, theta' = rn(theta + v),
// k' = SR(v - (theta' - theta)) with the compensation stream.
static inline void load_weight(const Pointers &p, int64_t i, vf w[2]) { load<WT>(p.w, i, w[0], w[1]); }

static inline void write_back_lanes(const Pointers &p, int64_t i, const Rng &rng, const vf w[2], const vf u[2],
                                    vi still[2]) {
  vf b[2], newb[2], neww[2];
  load<BT>(p.b, i, b[0], b[1]);
  vu noise[2];
  rng.template bits<COMPENSATION_STREAM>(noise);
  for (int h = 0; h < 2; h++) {
    vf v = b[h] + u[h];
    neww[h] = round_to<WT>(w[h] + v);
    vf change = neww[h] - w[h];
    newb[h] = stochastic_to<BT>(v - change, noise[h]);
    still[h] = change == 0.0f;
  }
  store<BT>(p.b, i, newb[0], newb[1]);
  store<WT>(p.w, i, neww[0], neww[1]);
}
