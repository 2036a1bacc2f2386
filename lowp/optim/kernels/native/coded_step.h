// lowp fused optimizer step, part 3: a variant whose states include block-scaled codes
// (LOWP_CODE_KINDS; lowp/optim/kernels/native_coded.py). Included after step.h. Per work unit
// the coded states are decoded into fp32 buffers of the thread (codes.h), the unit runs as step.h
// runs it on fp32 states, and the buffers are encoded back, rounded as the group's state_rounding
// says (LOWP_SR) with the random bits of the state's own stream. A unit holds whole blocks (UNIT is
// a multiple of every block size), and every block is encoded from its own values with the bits
// of its own elements, so the result is that of lowp/optim/coded.py's decode / step / encode
// passes bit for bit, while the fp32 states never leave the core's cache.
#pragma once
#include <vector>

#include "codes.h"

constexpr int CODE_KINDS[NSTATES + 1] = LOWP_CODE_KINDS;  // per state: its CodeKind, -1 for a plain state
constexpr int CODE_SCALE = LOWP_CODE_SCALE;
constexpr int64_t CODE_BLOCK = LOWP_CODE_BLOCK;
static_assert(CODE_BLOCK >= 8 && CODE_BLOCK <= MAX_BLOCK && UNIT % CODE_BLOCK == 0, "a unit holds whole blocks");
static_assert(!REDUCTION, "a per-tensor reduction would read the codes as states");
constexpr bool coded_states_are_fp32() {
  for (int j = 0; j < NSTATES; j++)
    if (CODE_KINDS[j] >= 0 && ST[j] != F32) return false;
  return true;
}
static_assert(coded_states_are_fp32(), "the rule sees a coded state as fp32");

// ``p`` moved on to element ``start`` (the coded states' pointers are left null: buffers replace them).
static Pointers shifted(const Pointers &p, int64_t start) {
  Pointers q;
  q.w = (char *)p.w + start * itemsize(role_type(0));
  q.g = (char *)p.g + start * itemsize(role_type(1));
  q.b = p.b ? (char *)p.b + start * itemsize(role_type(2)) : nullptr;
  for (int j = 0; j < NSTATES; j++) q.s[j] = CODE_KINDS[j] >= 0 ? nullptr : (char *)p.s[j] + start * itemsize(ST[j]);
  return q;
}

// As lowp_step, where ``ptrs[(3 + k) * tensors + j]`` are the codes of a coded state k, plus
// ``scales[k * tensors + j]``: their block scales (null for a plain state); ``grids[4 * k ...]``:
// the code's signed, Q, m and emin; ``tables[k]``: the fp32 values of fp8 codes (or null).
extern "C" int64_t lowp_coded_step(int64_t tensors, void *const *ptrs, const int64_t *numel, const int64_t *offset,
                                   const double *h, const double *tensor_numbers, const uint32_t *keys,
                                   void *const *scales, const double *grids, const float *const *tables, int threads) {
  Task t(tensors, ptrs, numel, h);
  t.offset = offset;
  t.keys = keys;
  t.tensor_numbers = tensor_numbers;
  std::vector<Grid> grid;
  for (int k = 0; k < NSTATES; k++)
    grid.emplace_back((int)grids[4 * k], (float)grids[4 * k + 1], (int)grids[4 * k + 2], (int)grids[4 * k + 3],
                      tables[k]);
  int64_t total = 0;
#pragma omp parallel num_threads(thread_count(threads, t.units())) reduction(+ : total)
  {
    std::vector<float> buffers((size_t)UNIT * NSTATES);
    total += work_units(&t, [&](int64_t tensor, const Pointers &p, int64_t start, int64_t end, uint64_t base,
                                TensorStreams &streams, const rule_uniform &r, const vf &factor, vi &stalled) {
      Pointers q = shifted(p, start);
      for_states([&](auto j) {
        constexpr int J = decltype(j)::value;
        if constexpr (CODE_KINDS[J] >= 0) {
          q.s[J] = buffers.data() + J * UNIT;
          decode_span<CODE_KINDS[J], CODE_SCALE>(p.s[J], scales[J * tensors + tensor], start, end, CODE_BLOCK,
                                                 grid[J], (float *)q.s[J]);
        }
      });
      step_unit(q, 0, end - start, base + start, streams, r, factor, stalled);
      for_states([&](auto j) {
        constexpr int J = decltype(j)::value;
        if constexpr (CODE_KINDS[J] >= 0) {
          const uint32_t key = keys[tensor * STREAMS + STATE_STREAM + J];
          encode_span<CODE_KINDS[J], CODE_SCALE, SR>((const float *)q.s[J], start, end, p.s[J],
                                                     scales[J * tensors + tensor], CODE_BLOCK, grid[J],
                                                     [&](int64_t i) { return CountedNoise{base + (uint64_t)i, key}; });
        }
      });
    });
  }
  return total;
}
