// master write-back (lowp/optim/writeback/master.py): the fp32 master t in the buffer;
// t' = rn_fp32(t + u), theta' = rn(t').
static_assert(BT == F32, "master mode: an fp32 master weight");

static inline void load_weight(const Pointers &p, int64_t i, vf w[2]) { load<F32>(p.b, i, w[0], w[1]); }

static inline void write_back_lanes(const Pointers &p, int64_t i, const Rng &rng, const vf w[2], const vf u[2],
                                    vi still[2]) {
  (void)rng;
  vf total[2], neww[2];
  for (int h = 0; h < 2; h++) {
    total[h] = w[h] + u[h];
    neww[h] = round_to<WT>(total[h]);
    still[h] = (total[h] - w[h]) == 0.0f;
  }
  store<F32>(p.b, i, total[0], total[1]);
  store<WT>(p.w, i, neww[0], neww[1]);
}
