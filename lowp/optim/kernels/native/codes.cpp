// lowp: the block-scaled codec (codes.h) over many tensors in one call, on torch's OpenMP threads
// (backend="native" and every CPU step with coded states; lowp/optim/kernels/native_codes.py
// checks every tensor before it calls here).
//
// Tensors are cut into units of whole blocks that the threads take from an atomic counter, as in
// step.h. A tensor's last block may be short, and its length need not be a multiple of 8: that
// block goes through zero-padded local buffers (zeros do not change a block's maximum).
#include <atomic>
#include <type_traits>
#include <vector>

#include "codes.h"

static constexpr int64_t UNIT = 1 << 14;  // elements per work unit (a multiple of every block size)

struct Units {
  int64_t tensors;
  const int64_t *numel;
  std::vector<int64_t> first;  // [tensor + 1] cumulative unit counts
  std::atomic<int64_t> next{0};

  Units(int64_t count, const int64_t *sizes) : tensors(count), numel(sizes) {
    first.assign(tensors + 1, 0);
    for (int64_t k = 0; k < tensors; k++) first[k + 1] = first[k] + (numel[k] + UNIT - 1) / UNIT;
  }
  // The next unit's tensor and element range [start, end); false when none is left.
  bool take(int64_t &tensor, int64_t &start, int64_t &end) {
    const int64_t unit = next.fetch_add(1);
    if (unit >= first[tensors]) return false;
    while (first[tensor + 1] <= unit) tensor++;
    start = (unit - first[tensor]) * UNIT;
    end = start + UNIT < numel[tensor] ? start + UNIT : numel[tensor];
    return true;
  }
};

static int thread_count(int threads, int64_t units) {
  int n = threads < 1 ? 1 : (threads > units ? (int)units : threads);
  return n < 1 ? 1 : n;
}

// byte offset of element ``i``'s code
template <int KIND> static inline int64_t code_offset(int64_t i) { return KIND == CODE_UINT4 ? i / 2 : i; }

// ptrs[role * tensors + k]: 0 the fp32 values, 1 the codes, 2 the scales, 3 the drawn random bits
// (int32) or null; first[k]: global index of element 0 (random bits drawn here); keys[k]: stream key.
template <int KIND, int S, bool SR, bool DRAWN>
static void encode_all(int64_t tensors, void *const *ptrs, const int64_t *numel, const uint64_t *first,
                       const uint32_t *keys, int64_t block, const Grid &g, int threads) {
  Units units(tensors, numel);
#pragma omp parallel num_threads(thread_count(threads, units.first[tensors]))
  {
    int64_t k = 0, start, end;
    alignas(32) float x_pad[MAX_BLOCK];
    alignas(32) int32_t bits_pad[MAX_BLOCK];
    alignas(32) uint8_t codes_pad[MAX_BLOCK];
    while (units.take(k, start, end)) {
      const float *x = (const float *)ptrs[k];
      uint8_t *codes = (uint8_t *)ptrs[tensors + k];
      void *scales = ptrs[2 * tensors + k];
      const int32_t *drawn = (const int32_t *)ptrs[3 * tensors + k];
      for (int64_t i = start; i < end; i += block) {
        const int64_t n = end - i < block ? end - i : block;
        // encode elements i .. i + n of tensor k from ``values`` (``bits``: their drawn random bits)
        auto run = [&](const float *values, const int32_t *bits, int64_t count, uint8_t *out) {
          if constexpr (DRAWN) {
            DrawnNoise noise{bits};
            encode_block<KIND, S, SR>(values, count, out, scales, i / block, g, noise);
          } else {
            CountedNoise noise{SR ? first[k] + (uint64_t)i : 0, SR ? keys[k] : 0};
            encode_block<KIND, S, SR>(values, count, out, scales, i / block, g, noise);
          }
        };
        if (n % 8 == 0) {
          run(x + i, DRAWN ? drawn + i : nullptr, n, codes + code_offset<KIND>(i));
          continue;
        }
        const int64_t padded = (n + 7) / 8 * 8;  // the padding encodes to code 0, as _pack4 pads
        memset(x_pad, 0, sizeof(float) * padded);
        memcpy(x_pad, x + i, sizeof(float) * n);
        if (DRAWN) {
          memset(bits_pad, 0, sizeof(int32_t) * padded);
          memcpy(bits_pad, drawn + i, sizeof(int32_t) * n);
        }
        run(x_pad, bits_pad, padded, codes_pad);
        memcpy(codes + code_offset<KIND>(i), codes_pad, KIND == CODE_UINT4 ? (n + 1) / 2 : n);
      }
    }
  }
}

// ptrs[role * tensors + k]: 0 the codes, 1 the scales, 2 the fp32 output.
template <int KIND, int S>
static void decode_all(int64_t tensors, void *const *ptrs, const int64_t *numel, int64_t block, const Grid &g,
                       int threads) {
  Units units(tensors, numel);
#pragma omp parallel num_threads(thread_count(threads, units.first[tensors]))
  {
    int64_t k = 0, start, end;
    alignas(32) uint8_t codes_pad[MAX_BLOCK];
    alignas(32) float out_pad[MAX_BLOCK];
    while (units.take(k, start, end)) {
      const uint8_t *codes = (const uint8_t *)ptrs[k];
      const void *scales = ptrs[tensors + k];
      float *out = (float *)ptrs[2 * tensors + k];
      for (int64_t i = start; i < end; i += block) {
        const int64_t n = end - i < block ? end - i : block;
        if (n % 8 == 0) {
          decode_block<KIND, S>(codes + code_offset<KIND>(i), n, scales, i / block, g, out + i);
          continue;
        }
        const int64_t padded = (n + 7) / 8 * 8;
        const int64_t bytes = KIND == CODE_UINT4 ? (n + 1) / 2 : n;
        memset(codes_pad, 0, sizeof(codes_pad));
        memcpy(codes_pad, codes + code_offset<KIND>(i), bytes);
        decode_block<KIND, S>(codes_pad, padded, scales, i / block, g, out_pad);
        memcpy(out + i, out_pad, sizeof(float) * n);
      }
    }
  }
}

// a power of two from 8 to MAX_BLOCK (so a unit holds whole blocks)
static bool block_known(int64_t block) { return block >= 8 && block <= MAX_BLOCK && (block & (block - 1)) == 0; }

template <typename F> static bool dispatch(int kind, int scale, F &&f) {
  auto with_scale = [&](auto k) {
    switch (scale) {
      case SCALE_F32: f(k, std::integral_constant<int, SCALE_F32>{}); return true;
      case SCALE_BF16: f(k, std::integral_constant<int, SCALE_BF16>{}); return true;
      case SCALE_F16: f(k, std::integral_constant<int, SCALE_F16>{}); return true;
    }
    return false;
  };
  switch (kind) {
    case CODE_INT8: return with_scale(std::integral_constant<int, CODE_INT8>{});
    case CODE_UINT8: return with_scale(std::integral_constant<int, CODE_UINT8>{});
    case CODE_UINT4: return with_scale(std::integral_constant<int, CODE_UINT4>{});
    case CODE_FP8: return with_scale(std::integral_constant<int, CODE_FP8>{});
  }
  return false;
}

// ``grid``: signed, then Q, m, emin (the Code's numbers); ``table``: fp8 byte values or null;
// ``mode``: 0 nearest, 1 stochastic with bits drawn here from (first, keys), 2 stochastic with
// the bits of ptrs role 3. Returns 0, or -1 for an unknown kind, scale dtype, mode or block.
extern "C" int lowp_encode(int64_t tensors, void *const *ptrs, const int64_t *numel, const uint64_t *first,
                           const uint32_t *keys, int kind, int scale, int64_t block, const double *grid, int mode,
                           int threads) {
  if (!block_known(block) || mode < 0 || mode > 2) return -1;
  const Grid g((int)grid[0], (float)grid[1], (int)grid[2], (int)grid[3], nullptr);
  bool known = dispatch(kind, scale, [&](auto k, auto s) {
    constexpr int K = decltype(k)::value, SC = decltype(s)::value;
    if (mode == 0) encode_all<K, SC, false, false>(tensors, ptrs, numel, first, keys, block, g, threads);
    else if (mode == 1) encode_all<K, SC, true, false>(tensors, ptrs, numel, first, keys, block, g, threads);
    else encode_all<K, SC, true, true>(tensors, ptrs, numel, first, keys, block, g, threads);
  });
  return known ? 0 : -1;
}

extern "C" int lowp_decode(int64_t tensors, void *const *ptrs, const int64_t *numel, int kind, int scale,
                           int64_t block, const double *grid, const float *table, int threads) {
  if (!block_known(block) || (kind == CODE_FP8 && table == nullptr)) return -1;
  const Grid g((int)grid[0], (float)grid[1], (int)grid[2], (int)grid[3], table);
  bool known = dispatch(kind, scale, [&](auto k, auto s) {
    decode_all<decltype(k)::value, decltype(s)::value>(tensors, ptrs, numel, block, g, threads);
  });
  return known ? 0 : -1;
}
