// lowp fused optimizer step, part 3: a variant whose states include block-scaled codes
// (LOWP_CODE_KINDS, read by vector.h; NativeKernel.run_coded in lowp/optim/kernels/native/kernel.py). Included after
// step.h. The codes are decoded and encoded in registers, next to the rule, in groups of
// CODED_GROUP (256) elements (whole blocks of every size):
//
//   pass 1, block by block (the block's scales and running peaks in registers), per BLOCK (2 * LANES)
//           elements:
//           load weight, gradient, plain states and the codes of the coded states; decode them
//           (q * s, squared for unsigned codes; fp8 codes through their fp16 patterns, codes.h's
//           fp8_values); the rule; store the plain states; keep the coded states' new values t
//           (for unsigned codes their square roots: the rule's own sqrt of the second moment,
//           which the compiler computes once), the update and the weight in L1, and each block's
//           peak |t| (an integer max on the bit patterns);
//   pass 2: the scales and reciprocals of all the group's blocks of a state at once, from the peaks
//           (codes.h's block_scales: one vector division for up to 8 blocks instead of a scalar
//           chain per block); then per block, per BLOCK elements, step.h's write-back of the kept
//           weight and update, and the codes of t with the random bits of the state's own stream
//           (the Rng of step.h, as for 16-bit states; one key fold per group, GroupRng); a block
//           where every coded state takes its fixed path (the common case) runs code without the
//           general path's checks.
//
// Every block is encoded from its own values with the bits of its own elements, so the result is
// that of lowp/optim/coded.py's decode / step / encode passes bit for bit. The decoded states use
// step.h's (even, odd) lanes: 2 * LANES one-byte codes are one load whose 16-bit halves split
// into the two vectors with shifts (4-bit codes: LANES bytes, low and high nibbles). The last group
// of a tensor (fewer than CODED_GROUP elements) runs on zero-padded local copies, its padding
// lanes masked out of the block peaks.
#pragma once
#include <array>
#include <utility>

#include "codes.h"

constexpr int64_t CODE_BLOCK = LOWP_CODE_BLOCK;
constexpr int64_t CODED_GROUP = MAX_BLOCK;           // elements per group: whole blocks of every size
constexpr int SUBS = CODED_GROUP / BLOCK;            // steps of BLOCK elements per group
constexpr int BLOCK_SUBS = CODE_BLOCK / BLOCK;       // steps of BLOCK elements per code block
static_assert(CODE_BLOCK % BLOCK == 0 && CODE_BLOCK <= MAX_BLOCK && UNIT % CODED_GROUP == 0,
              "a group holds whole blocks, a unit whole groups");
static_assert(CODED_GROUP / CODE_BLOCK <= 8, "a group's scales are computed in one vector");
static_assert(!REDUCTION, "a per-tensor reduction would read the codes as states");
constexpr bool coded_states_are_fp32() {
  for (int j = 0; j < NSTATES; j++)
    if (coded_state(j) && ST[j] != F32) return false;
  return true;
}
static_assert(coded_states_are_fp32(), "the rule sees a coded state as fp32");
constexpr bool plain_states_draw() {
  for (int j = 0; j < NSTATES; j++)
    if (!coded_state(j) && used_stream(STATE_STREAM + j)) return true;
  return false;
}

// Bits of state j's codes (0: a plain state).
template <int J> constexpr int code_bits_of() {
  if constexpr (coded_state(J)) return Storage<CODE_KINDS[J]>::BITS;
  else return 0;
}
template <size_t... J> constexpr std::array<int, NSTATES + 1> code_bits_table(std::index_sequence<J...>) {
  return {code_bits_of<(int)J>()...};
}
constexpr std::array<int, NSTATES + 1> CODE_BITS = code_bits_table(std::make_index_sequence<NSTATES + 1>{});

// The lanes of BLOCK elements from group element ``e`` that are inside the tensor's ``count`` (MASKED).
static inline void valid_lanes(int64_t e, int64_t count, vi valid[2]) {
  vi even;
  for (int l = 0; l < LANES; l++) even[l] = 2 * l;
  for (int h = 0; h < 2; h++) valid[h] = even + (int)(e + h) < (int)count;
}

// One group: ``subs`` steps of BLOCK elements (whole blocks) from element ``i`` of the memory at
// ``p`` (coded states: their codes), whose first block is scale ``block0`` of ``scales[J]`` and
// whose first element has global index ``index``. MASKED: only the first ``count`` elements are
// the tensor's (the tail's local copies). Always inlined: GCC kept the full-group instantiation
// out of line in fp8 variants, where ``subs`` then is no constant (2.1 -> 2.9 ns per element).
template <bool MASKED>
__attribute__((always_inline)) static inline void coded_group(const Pointers &p, int64_t i, void *const *scales,
                                                              int64_t block0, uint64_t index, int subs, int64_t count,
                                                              TensorStreams &streams, const rule_uniform &r,
                                                              const vf &factor, const Grid *grid, vi &stalled) {
  vf u[SUBS][2], weight[SUBS][2];  // pass 1's updates and weights, for pass 2
  vf t[NSTATES + 1][SUBS][2];
  vu8 peak[NSTATES + 1][8];  // per block (lane_maxima's 8 vectors; those past the group's blocks are 0)
  vi valid[2];
  const int blocks = subs / BLOCK_SUBS;
  GroupRng rngs(streams, index, BLOCK * subs);  // for both passes
  for (int b = 0; b < blocks; b++) {
    // the block's scales and running peaks, in registers for its BLOCK_SUBS steps
    vf scale[NSTATES + 1];
    vu most[NSTATES + 1];
    for_states([&](auto j) {
      constexpr int J = decltype(j)::value;
      if constexpr (coded_state(J)) {
        scale[J] = bc(scale_at<CODE_SCALE>(scales[J], block0 + b));
        most[J] = vu{};
      }
    });
    for (int k = b * BLOCK_SUBS; k < (b + 1) * BLOCK_SUBS; k++) {
      const int64_t e = i + BLOCK * k;
      if constexpr (MASKED) valid_lanes(BLOCK * k, count, valid);
      vf w[2], g[2], s[2][NSTATES + 1], out[2][NSTATES + 1];
      load_weight_and_grad(p, e, factor, w, g);
      weight[k][0] = w[0], weight[k][1] = w[1];
      for_states([&](auto j) {
        constexpr int J = decltype(j)::value;
        if constexpr (coded_state(J)) {
          Storage<CODE_KINDS[J]>::load_lanes(p.s[J], e, s[0][J], s[1][J]);
          for (int h = 0; h < 2; h++) {
            s[h][J] *= scale[J];
            if constexpr (unsigned_kind<CODE_KINDS[J]>()) s[h][J] *= s[h][J];
          }
        } else {
          load<ST[J]>(p.s[J], e, s[0][J], s[1][J]);
        }
      });
      for (int h = 0; h < 2; h++) u[k][h] = rule(r, w[h], g[h], s[h], out[h]);
      Rng rng;
      if constexpr (plain_states_draw()) rng = rngs.at(BLOCK * k);
      for_states([&](auto j) {
        constexpr int J = decltype(j)::value;
        if constexpr (coded_state(J)) {
          for (int h = 0; h < 2; h++) {
            vf v = unsigned_kind<CODE_KINDS[J]>() ? sqrt_(out[h][J]) : out[h][J];
            if constexpr (MASKED) v = select(valid[h], v, bc(0.0f));
            t[J][k][h] = v;
            most[J] = peak_of(most[J], v);
          }
        } else {
          store_state<J>(p.s[J], e, out[0][J], out[1][J], rng);
        }
      });
    }
    for_states([&](auto j) {
      constexpr int J = decltype(j)::value;
      if constexpr (coded_state(J)) peak[J][b] = peak8(most[J]);
    });
  }
  for_states([&](auto j) {
    constexpr int J = decltype(j)::value;
    if constexpr (coded_state(J))
      for (int b = blocks; b < 8; b++) peak[J][b] = vu8{};
  });
  BlockScales group_scales[NSTATES + 1];
  for_states([&](auto j) {
    constexpr int J = decltype(j)::value;
    if constexpr (coded_state(J))
      group_scales[J] = block_scales<CODE_SCALE>(scales[J], block0, blocks, lane_maxima(peak[J]), grid[J]);
  });
  for (int b = 0; b < blocks; b++) {
    BlockScale bs[NSTATES + 1];
    bool fixed = true;  // every coded state's block takes its fixed path
    for_states([&](auto j) {
      constexpr int J = decltype(j)::value;
      if constexpr (coded_state(J)) {
        bs[J] = group_scales[J][b];
        fixed &= bs[J].fixed && (!fp8_kind<CODE_KINDS[J]>() || SR);
      }
    });
    auto run = [&](auto all_fixed) {
      constexpr bool ALL_FIXED = decltype(all_fixed)::value;
      for (int k = b * BLOCK_SUBS; k < (b + 1) * BLOCK_SUBS; k++) {
        const int64_t e = i + BLOCK * k;
        const Rng rng = rngs.at(BLOCK * k);
        if constexpr (MASKED) valid_lanes(BLOCK * k, count, valid);
        write_back_block(p, e, rng, weight[k], u[k], MASKED ? valid : ALL_VALID, stalled);
        for_states([&](auto j) {
          constexpr int J = decltype(j)::value;
          if constexpr (coded_state(J)) {
            constexpr int KIND = CODE_KINDS[J];
            constexpr bool FIXED = ALL_FIXED && (!fp8_kind<KIND>() || SR);
            vu noise[2] = {};
            if constexpr (SR) rng.template bits<STATE_STREAM + J>(noise);
            vi c[2];
            for (int h = 0; h < 2; h++) c[h] = code_lanes<KIND, SR, FIXED>(t[J][k][h], bs[J], grid[J], noise[h]);
            Storage<KIND>::store_lanes(p.s[J], e, c[0], c[1]);
          }
        });
      }
    };
    if (fixed) run(std::true_type{});
    else run(std::false_type{});
  }
}

// Byte offsets of state J's elements, its codes' when it is coded (step.h's prefetch_group).
struct CodedBytes {
  template <int J> static inline int64_t of(int64_t i) {
    if constexpr (coded_state(J)) return code_offset<CODE_KINDS[J]>(i);
    else return PlainBytes::of<J>(i);
  }
};

// Bytes of ``count`` elements of role ``role`` (coded states: their codes).
static inline int64_t role_bytes(int role, int64_t count) {
  if (role >= 3 && coded_state(role - 3)) return CODE_BITS[role - 3] == 4 ? (count + 1) / 2 : count;
  return count * itemsize(role_type(role));
}

// The last ``count`` (< CODED_GROUP) elements of a tensor, from element ``i``: through zero-padded
// local copies (every read in bounds), the written ones copied back. A 4-bit state with an odd count
// keeps its unused high nibble 0, as pack4 pads.
static void coded_tail(const Pointers &p, int64_t i, int64_t count, void *const *scales, uint64_t base,
                       TensorStreams &streams, const rule_uniform &r, const vf &factor, const Grid *grid, vi &stalled) {
  alignas(32) unsigned char local[ROLES][CODED_GROUP * 4] = {};
  Pointers q;
  void **dst[ROLES];
  void *orig[ROLES];
  role_table(p, q, orig, dst);
  for (int role = 0; role < ROLES; role++) {
    *dst[role] = local[role];
    if (orig[role])
      memcpy(local[role], (char *)orig[role] + role_bytes(role, i), role_bytes(role, count));
  }
  const int subs = (int)((count + CODE_BLOCK - 1) / CODE_BLOCK * BLOCK_SUBS);
  coded_group<true>(q, 0, scales, i / CODE_BLOCK, base + i, subs, count, streams, r, factor, grid, stalled);
  for (int role = 0; role < ROLES; role++) {
    if (!orig[role] || role == 1) continue;
    if (role >= 3 && CODE_BITS[role - 3] == 4 && count % 2) local[role][count / 2] &= 0x0F;
    memcpy((char *)orig[role] + role_bytes(role, i), local[role], role_bytes(role, count));
  }
}

// As lowp_step, where ``ptrs[(3 + k) * tensors + j]`` are the codes of a coded state k, plus
// ``scales[k * tensors + j]``: their block scales (null for a plain state); ``grids[4 * k ...]``:
// the code's signed, Q, m and emin.
extern "C" int64_t lowp_coded_step(int64_t tensors, void *const *ptrs, const int64_t *numel, const int64_t *offset,
                                   const double *h, const double *tensor_numbers, uint64_t seed, uint64_t step,
                                   const int64_t *param_ids, int check, uint8_t *finite, void *const *scales,
                                   const double *grids, int threads) {
  Task t(tensors, ptrs, numel, h, offset, tensor_numbers);
  t.set_keys(seed, step, param_ids);
  std::vector<Grid> grid;
  for (int k = 0; k < NSTATES; k++)
    grid.emplace_back((int)grids[4 * k], (float)grids[4 * k + 1], (int)grids[4 * k + 2], (int)grids[4 * k + 3]);
  return run_units(t, threads, check, finite, [&](int64_t tensor, const Pointers &p, int64_t start, int64_t end, uint64_t base,
                                   TensorStreams &streams, const rule_uniform &r, const vf &factor, vi &stalled) {
    void *own[NSTATES + 1] = {};
    for (int j = 0; j < NSTATES; j++) own[j] = scales[j * tensors + tensor];
    int64_t i = start;
    for (; i + CODED_GROUP <= end; i += CODED_GROUP) {
      if (i + (PREFETCH_GROUPS + 1) * CODED_GROUP <= end)
        prefetch_group<CODED_GROUP, CodedBytes>(p, i + PREFETCH_GROUPS * CODED_GROUP);
      coded_group<false>(p, i, own, i / CODE_BLOCK, base + i, SUBS, CODED_GROUP, streams, r, factor, grid.data(),
                         stalled);
    }
    if (i < end) coded_tail(p, i, end - i, own, base, streams, r, factor, grid.data(), stalled);
  });
}
