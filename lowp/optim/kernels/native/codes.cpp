// lowp: the block-scaled codec (codes.h) over many tensors in one call, on torch's OpenMP threads
// (backend="native" and every CPU step with coded states; lowp/optim/kernels/native/codec.py
// checks every tensor before it calls here).
//
// Tensors are cut into units of whole blocks that the threads take from an atomic counter
// (parallel.h); codes.h's spans do the rest. The translation unit that includes this file first
// includes every encoding's header (their Storage specializations) and defines LOWP_CODE_KIND_LIST,
// their kinds (lowp/optim/kernels/native/codec.py writes it from lowp.optim.encodings.CODES).
#include <utility>

#include "codes.h"
#include "parallel.h"

#ifndef LOWP_CODE_KIND_LIST
#error "the codec's translation unit defines LOWP_CODE_KIND_LIST after including the encodings' headers"
#endif

static constexpr int64_t UNIT = 1 << 14;  // elements per work unit (a multiple of every block size)

// ptrs[role * tensors + k]: 0 the fp32 values, 1 the codes, 2 the scales, 3 the drawn random bits
// (int32) or null; first[k]: global index of element 0 (random bits drawn here); keys[k]: stream key.
template <int KIND, int S, bool SR, bool DRAWN>
static void encode_all(int64_t tensors, void *const *ptrs, const int64_t *numel, const uint64_t *first,
                       const uint32_t *keys, int64_t block, const Grid &g, int threads) {
  Units<UNIT> units(tensors, numel);
#pragma omp parallel num_threads(thread_count(threads, units.count()))
  {
    for (Unit u; units.take(u);) {
      const int64_t k = u.tensor;
      const float *x = (const float *)ptrs[k] + u.start;
      const int32_t *drawn = (const int32_t *)ptrs[3 * tensors + k];
      const uint64_t base = SR && !DRAWN ? first[k] : 0;
      const uint32_t key = SR && !DRAWN ? keys[k] : 0;
      encode_span<KIND, S, SR>(x, u.start, u.end, ptrs[tensors + k], ptrs[2 * tensors + k], block, g, [&](int64_t i) {
        if constexpr (DRAWN) return DrawnNoise{drawn + i};
        else return CountedNoise{base + (uint64_t)i, key, {}};
      });
    }
  }
}

// ptrs[role * tensors + k]: 0 the codes, 1 the scales, 2 the fp32 output.
template <int KIND, int S>
static void decode_all(int64_t tensors, void *const *ptrs, const int64_t *numel, int64_t block, int threads) {
  Units<UNIT> units(tensors, numel);
#pragma omp parallel num_threads(thread_count(threads, units.count()))
  for (Unit u; units.take(u);)
    decode_span<KIND, S>(ptrs[u.tensor], ptrs[tensors + u.tensor], u.start, u.end, block,
                         (float *)ptrs[2 * tensors + u.tensor] + u.start);
}

// a power of two from 8 to MAX_BLOCK (so a unit holds whole blocks)
static bool block_known(int64_t block) { return block >= 8 && block <= MAX_BLOCK && (block & (block - 1)) == 0; }

template <typename F, int... K> static bool dispatch_kinds(int kind, F &&with_scale, std::integer_sequence<int, K...>) {
  return ((kind == K && with_scale(std::integral_constant<int, K>{})) || ...);
}

template <typename F> static bool dispatch(int kind, int scale, F &&f) {
  auto with_scale = [&](auto k) {
    switch (scale) {
      case SCALE_F32: f(k, std::integral_constant<int, SCALE_F32>{}); return true;
      case SCALE_BF16: f(k, std::integral_constant<int, SCALE_BF16>{}); return true;
      case SCALE_F16: f(k, std::integral_constant<int, SCALE_F16>{}); return true;
    }
    return false;
  };
  return dispatch_kinds(kind, with_scale, std::integer_sequence<int, LOWP_CODE_KIND_LIST>{});
}

// ``grid``: signed, then Q, m, emin (the Code's numbers);
// ``mode``: 0 nearest, 1 stochastic with bits drawn here from (first, keys), 2 stochastic with
// the bits of ptrs role 3. Returns 0, or -1 for an unknown kind, scale dtype, mode or block.
extern "C" int lowp_encode(int64_t tensors, void *const *ptrs, const int64_t *numel, const uint64_t *first,
                           const uint32_t *keys, int kind, int scale, int64_t block, const double *grid, int mode,
                           int threads) {
  if (!block_known(block) || mode < 0 || mode > 2) return -1;
  const Grid g((int)grid[0], (float)grid[1], (int)grid[2], (int)grid[3]);
  bool known = dispatch(kind, scale, [&](auto k, auto s) {
    constexpr int K = decltype(k)::value, SC = decltype(s)::value;
    if (mode == 0) encode_all<K, SC, false, false>(tensors, ptrs, numel, first, keys, block, g, threads);
    else if (mode == 1) encode_all<K, SC, true, false>(tensors, ptrs, numel, first, keys, block, g, threads);
    else encode_all<K, SC, true, true>(tensors, ptrs, numel, first, keys, block, g, threads);
  });
  return known ? 0 : -1;
}

extern "C" int lowp_decode(int64_t tensors, void *const *ptrs, const int64_t *numel, int kind, int scale,
                           int64_t block, int threads) {
  if (!block_known(block)) return -1;
  bool known = dispatch(kind, scale, [&](auto k, auto s) {
    decode_all<decltype(k)::value, decltype(s)::value>(tensors, ptrs, numel, block, threads);
  });
  return known ? 0 : -1;
}
