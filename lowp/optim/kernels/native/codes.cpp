// lowp: the block-scaled codec (codes.h) over many tensors in one call, on torch's OpenMP threads
// (backend="native" and every CPU step with coded states; lowp/optim/kernels/native/codec.py
// checks every tensor before it calls here).
//
// Tensors are cut into units of whole blocks that the threads take from an atomic counter
// (parallel.h); the spans below do the rest, block by block, 8 values at a time. The translation
// unit that includes this file first includes every encoding's header (their Storage
// specializations) and defines LOWP_CODE_KIND_LIST, their kinds (lowp/optim/kernels/native/codec.py
// writes it from lowp.optim.encodings.CODES).
#include <utility>

#include "codes.h"
#include "parallel.h"

#ifndef LOWP_CODE_KIND_LIST
#error "the codec's translation unit defines LOWP_CODE_KIND_LIST after including the encodings' headers"
#endif

static_assert(LANES == 8, "the codec runs on 8 lanes (the storages' load8 and store8)");

// ---- random bits of the elements of a block ------------------------------------------------------
// Stochastic rounding draws random16(i, key) for global element index i = first + j (the element's
// index in its whole parameter: lowp.optim.randomness), or reads bits the caller drew.
struct CountedNoise {
  uint64_t first;
  uint32_t key;
  FoldedKeys<1> folded;

  // the bits of elements j .. j + 7
  inline vu at(int64_t j) {
    const uint64_t g = first + (uint64_t)j;
    folded.fold(&key, g);
    const uint32_t lo = (uint32_t)g;
    const vu lanes = (vu){0, 1, 2, 3, 4, 5, 6, 7} + lo;
    if (__builtin_expect(lo <= 0xFFFFFFF8u, 1)) return random16(lanes, bcu(folded.k0[0]));
    return random16(lanes, folded.wrapped(0, lanes, lo));
  }
  // the noise of a block of ``n`` elements padded to a multiple of 8 (the bits are computed: no read)
  inline CountedNoise &padded(int64_t, int32_t *) { return *this; }
};

struct DrawnNoise {
  const int32_t *bits;
  inline vu at(int64_t j) const {
    vu v;
    memcpy(&v, bits + j, 32);
    return v;
  }
  // the bits of a block of ``n`` elements padded to a multiple of 8: copied into ``local``
  inline DrawnNoise padded(int64_t n, int32_t *local) const {
    memset(local, 0, sizeof(int32_t) * MAX_BLOCK);
    memcpy(local, bits, sizeof(int32_t) * n);
    return DrawnNoise{local};
  }
};

// ---- one block ---------------------------------------------------------------------------------
// The codes of the ``n`` values t (a multiple of 8) of a block whose scale is ``bs``.
template <int KIND, bool SR, bool FIXED, typename Noise>
static inline void encode_values(const float *t, int64_t n, void *codes, const BlockScale &bs, const Grid &g,
                                 Noise &noise) {
  for (int64_t j = 0; j < n; j += 8) {
    vf v;
    memcpy(&v, t + j, 32);
    Storage<KIND>::store8(codes, j, code_lanes<KIND, SR, FIXED>(v, bs, g, SR ? noise.at(j) : vu{}));
  }
}

// Encode ``n`` values (a multiple of 8, at most MAX_BLOCK) from ``x`` into the codes from
// ``codes`` (byte offset of element 0 of the block) and scale ``b``.
template <int KIND, int S, bool SR, typename Noise>
static inline void encode_block(const float *x, int64_t n, void *codes, void *scales, int64_t b, const Grid &g,
                                Noise &noise) {
  alignas(32) float roots[MAX_BLOCK];
  const float *t = x;
  vu peak = {};
  for (int64_t j = 0; j < n; j += 8) {
    vf v;
    memcpy(&v, x + j, 32);
    if constexpr (unsigned_kind<KIND>()) {
      v = sqrt_(v);
      memcpy(roots + j, &v, 32);
    }
    peak = peak_of(peak, v);
  }
  if constexpr (unsigned_kind<KIND>()) t = roots;
  const vu peaks[8] = {peak};
  const BlockScale bs = block_scales<S>(scales, b, 1, lane_maxima(peaks), g)[0];
  if (bs.fixed && (!fp8_kind<KIND>() || SR)) encode_values<KIND, SR, !fp8_kind<KIND>() || SR>(t, n, codes, bs, g, noise);
  else encode_values<KIND, SR, false>(t, n, codes, bs, g, noise);
}

// Decode ``n`` values (a multiple of 8) of scale ``b`` into ``out``.
template <int KIND, int S>
static inline void decode_block(const void *codes, int64_t n, const void *scales, int64_t b, float *out) {
  const vf s = bc(scale_at<S>(scales, b));
  for (int64_t j = 0; j < n; j += 8) {
    vf y = Storage<KIND>::load8(codes, j) * s;
    if constexpr (unsigned_kind<KIND>()) y = y * y;
    memcpy(out + j, &y, 32);
  }
}

// ---- a range of whole blocks ---------------------------------------------------------------------
// Elements [start, end) of a tensor (start at a block boundary; end at one or at the tensor's end),
// with ``values`` holding element ``start`` first, ``codes`` and ``scales`` the tensor's own. The
// tensor's last block may be short and need not hold a multiple of 8 elements: it goes through
// zero-padded local buffers (zeros do not change a block's maximum; an odd uint4 tail's unused
// high nibble is cleared to 0, as _pack4 pads). ``noise(i)``: the random bits of the block from
// element i (unused to nearest).
template <int KIND, int S, bool SR, typename NoiseAt>
static inline void encode_span(const float *values, int64_t start, int64_t end, void *codes, void *scales,
                               int64_t block, const Grid &g, NoiseAt noise) {
  uint8_t *c = (uint8_t *)codes;
  for (int64_t i = start; i < end; i += block) {
    const int64_t n = end - i < block ? end - i : block;
    auto bits = noise(i);
    if (n % 8 == 0) {
      encode_block<KIND, S, SR>(values + (i - start), n, c + code_offset<KIND>(i), scales, i / block, g, bits);
      continue;
    }
    alignas(32) float x[MAX_BLOCK] = {};
    alignas(32) int32_t local_bits[MAX_BLOCK];
    alignas(32) uint8_t out[MAX_BLOCK];
    memcpy(x, values + (i - start), sizeof(float) * n);
    auto &&tail_bits = bits.padded(n, local_bits);
    encode_block<KIND, S, SR>(x, (n + 7) / 8 * 8, out, scales, i / block, g, tail_bits);
    if (Storage<KIND>::BITS == 4 && n % 2) out[n / 2] &= 0x0F;  // the unused high nibble is 0, as pack4 pads
    memcpy(c + code_offset<KIND>(i), out, code_bytes<KIND>(n));
  }
}

// Decode elements [start, end) (as encode_span) into ``out`` (element ``start`` first).
template <int KIND, int S>
static inline void decode_span(const void *codes, const void *scales, int64_t start, int64_t end, int64_t block,
                               float *out) {
  const uint8_t *c = (const uint8_t *)codes;
  for (int64_t i = start; i < end; i += block) {
    const int64_t n = end - i < block ? end - i : block;
    if (n % 8 == 0) {
      decode_block<KIND, S>(c + code_offset<KIND>(i), n, scales, i / block, out + (i - start));
      continue;
    }
    alignas(32) uint8_t local[MAX_BLOCK] = {};
    alignas(32) float y[MAX_BLOCK];
    memcpy(local, c + code_offset<KIND>(i), code_bytes<KIND>(n));
    decode_block<KIND, S>(local, (n + 7) / 8 * 8, scales, i / block, y);
    memcpy(out + (i - start), y, sizeof(float) * n);
  }
}

// ---- many tensors ------------------------------------------------------------------------------
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
