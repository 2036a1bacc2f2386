// lowp fused optimizer step for x86-64 CPUs with AVX2 + FMA + F16C (backend="native").
//
// One shared object per variant: the Python side (lowp/optim/kernels/native_build.py) compiles
// this file with -D LOWP_* macros that fix the optimizer rule, its structural switches, the
// write-back mode, every tensor's dtype and the state roundings, so the loop below carries no
// run-time branches on them. The math mirrors lowp/optim/kernels/rules.py and step.py rounding
// by rounding (explicit fused multiply-adds where ATen's CPU kernels use them, correctly
// rounded sqrt and true divisions), so results are bit-identical to the foreach reference, and
// stochastic rounding draws the counter-based bits of lowp/optim/randomness.py, as every backend.
//
// Layout trick: 16 elements are processed at a time as two fp32 vectors, the even-indexed
// elements ("lo") and the odd-indexed ones ("hi"). A bf16 block of 16 is one 32-byte load; its
// even elements are `x << 16` and its odd ones `x & 0xFFFF0000`, and storing is `hi | lo >> 16`:
// no shuffles at all for bf16 (fp32 and fp16 tensors pay one shuffle pair per 8 elements).
// Elementwise math does not care in which order the lanes hold the elements.
//
// Driver: tensors are cut into work units of UNIT elements that torch's OpenMP threads take
// from an atomic counter; within a unit, groups of GROUP elements go through two passes
// (update_block, then write_back_block). StableAdamW first runs a per-tensor reduction pass
// (stable_sums, stable_scales). Measurements behind these choices: docs/fused.md.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <vector>

// ---- the variant (defaults only make the file compile on its own) ----------------------------
#ifndef LOWP_RULE
#define LOWP_RULE 0
#endif
#ifndef LOWP_MODE
#define LOWP_MODE 2
#endif
#ifndef LOWP_CFG0
#define LOWP_CFG0 0
#endif
#ifndef LOWP_CFG1
#define LOWP_CFG1 1
#endif
#ifndef LOWP_CFG2
#define LOWP_CFG2 1
#endif
#ifndef LOWP_W
#define LOWP_W 1
#endif
#ifndef LOWP_G
#define LOWP_G 1
#endif
#ifndef LOWP_B
#define LOWP_B 1
#endif
#ifndef LOWP_NSTATES
#define LOWP_NSTATES 2
#endif
#ifndef LOWP_S0
#define LOWP_S0 1
#endif
#ifndef LOWP_S1
#define LOWP_S1 1
#endif
#ifndef LOWP_S2
#define LOWP_S2 1
#endif
#ifndef LOWP_SR
#define LOWP_SR 1
#endif
#ifndef LOWP_COUNT
#define LOWP_COUNT 1
#endif

enum Dtype { F32 = 0, BF16 = 1, F16 = 2, I16 = 3 };
enum Mode { NEAREST = 0, STOCHASTIC = 1, KAHAN = 2, EXACT = 3 };
enum RuleId { ADAM = 0, SGD = 1, LION = 2, RADAM = 3, STABLE = 4 };

constexpr int RULE = LOWP_RULE, MODE = LOWP_MODE, NSTATES = LOWP_NSTATES;
constexpr bool CFG[3] = {LOWP_CFG0 != 0, LOWP_CFG1 != 0, LOWP_CFG2 != 0};  // the rule's config tuple
constexpr int WT = LOWP_W, GT = LOWP_G, BT = LOWP_B, ST[3] = {LOWP_S0, LOWP_S1, LOWP_S2};
constexpr bool SR = LOWP_SR != 0, COUNT = LOWP_COUNT != 0;
static_assert(RULE >= ADAM && RULE <= STABLE && MODE >= NEAREST && MODE <= EXACT, "unknown rule or mode");
static_assert(WT <= F16 && GT <= F16 && BT <= I16 && ST[0] <= F16 && ST[1] <= F16 && ST[2] <= F16, "unknown dtype");
static_assert(NSTATES >= 0 && NSTATES <= 3, "at most three states");
static_assert(MODE != EXACT || (WT == BF16 && BT == I16), "exact mode: bf16 weights and an int16 remainder");
static_assert(MODE != STOCHASTIC || WT == BF16 || WT == F16, "stochastic write-back: bf16 or fp16 weights");

typedef float vf __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));

static inline vf bc(float x) { return (vf)_mm256_set1_ps(x); }
static inline vu bcu(uint32_t x) { return (vu)_mm256_set1_epi32((int)x); }
static inline vf fma_(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
static inline vf sqrt_(vf a) { return (vf)_mm256_sqrt_ps((__m256)a); }  // correctly rounded
static inline vf select(vi mask, vf a, vf b) { return mask ? a : b; }

// ---- loads and stores of 16 elements as (even, odd) fp32 vectors ------------------------------
static inline void deinterleave(vf a, vf b, vf &even, vf &odd) {
  // a = elements 0..7, b = 8..15 -> even = 0,2,..,14 and odd = 1,3,..,15
  even = (vf)_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps((__m256)a, (__m256)b, 0x88)), 0xD8));
  odd = (vf)_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps((__m256)a, (__m256)b, 0xDD)), 0xD8));
}

static inline void interleave(vf even, vf odd, vf &a, vf &b) {
  __m256 e = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd((__m256)even), 0xD8));
  __m256 o = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd((__m256)odd), 0xD8));
  a = (vf)_mm256_unpacklo_ps(e, o);
  b = (vf)_mm256_unpackhi_ps(e, o);
}

template <int DT> static inline void load(const void *base, int64_t i, vf &lo, vf &hi) {
  if constexpr (DT == BF16) {
    vu x;
    memcpy(&x, (const uint16_t *)base + i, 32);
    lo = (vf)(x << 16);
    hi = (vf)(x & 0xFFFF0000u);
  } else if constexpr (DT == F16) {
    const __m128i *p = (const __m128i *)((const uint16_t *)base + i);
    deinterleave((vf)_mm256_cvtph_ps(_mm_loadu_si128(p)), (vf)_mm256_cvtph_ps(_mm_loadu_si128(p + 1)), lo, hi);
  } else {
    vf a, b;
    memcpy(&a, (const float *)base + i, 32);
    memcpy(&b, (const float *)base + i + 8, 32);
    deinterleave(a, b, lo, hi);
  }
}

// NaN guard of the bf16 roundings below. Adding up to 0xFFFF to the bit pattern can carry a NaN
// into the sign bit (0x7FFFFFFF + 0x8000 is -0.0) only when its low 16 bits are not all zero.
// Every NaN of a variant whose floating-point inputs are all bf16 has zero low bits: loaded bf16
// values do, the hardware's default NaN (0xFFC00000) does, and arithmetic passes a NaN operand's
// payload on. So only variants reading fp32 or fp16 tensors pay for the guard (a compare and a
// blend per rounding). Exact mode's weight carries an int16 remainder in its low bits, which a
// NaN weight passes on to the states (through weight decay), so it pays too.
constexpr bool NAN_GUARD = WT != BF16 || GT != BF16 || (MODE == KAHAN && BT != BF16) || MODE == EXACT ||
                           (NSTATES > 0 && ST[0] != BF16) || (NSTATES > 1 && ST[1] != BF16) ||
                           (NSTATES > 2 && ST[2] != BF16);

static inline vf nan_guard(vf x, vu rounded) {
  if constexpr (NAN_GUARD) return (vf)((x != x) ? bcu(0x7FC00000u) : rounded);
  else return (vf)rounded;
}

// fp32 -> the nearest bf16 (ties to even), as an fp32 value.
static inline vf round_bf16(vf x) {
  vu u = (vu)x;
  return nan_guard(x, (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
}

// fp32 -> bf16 with stochastic rounding: add 16 random bits to the pattern and truncate. A NaN
// keeps its sign and top payload bits with the quiet bit set (lowp/optim/storage.py); without the
// guard (all-bf16 variants) every NaN already is such a value, which the rounding leaves alone.
static inline vf stochastic_bf16(vf x, vu noise) {
  vu rounded = ((vu)x + noise) & 0xFFFF0000u;
  if constexpr (NAN_GUARD) return (vf)((x != x) ? (((vu)x & 0xFFFF0000u) | 0x00400000u) : rounded);
  else return (vf)rounded;
}

static inline vf round_f16(vf x) {
  return (vf)_mm256_cvtph_ps(_mm256_cvtps_ph((__m256)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// fp32 -> fp16 with stochastic rounding, 16 random bits: with t = x truncated toward zero and
// ulp the fp16 spacing above |t| (2^(e-10), at least 2^-24 in the subnormal range), round away
// from zero when floor(frac * 2^16) + noise >= 2^16, frac = (|x| - |t|) / ulp (exact: Sterbenz,
// and ulp is a power of two). P(up) = frac for normal fp16 values (13 dropped bits < 16); beyond
// 65504 + ulp the result is +-inf (65536 stores as inf), and inf and NaN stay themselves.
static inline vf stochastic_f16(vf x, vu noise) {
  const vu sign_bit = bcu(0x80000000u);
  vf t = (vf)_mm256_cvtph_ps(_mm256_cvtps_ph((__m256)x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC));
  vf at = (vf)((vu)t & ~sign_bit), ax = (vf)((vu)x & ~sign_bit);
  vf spacing = (vf)((vu)at & 0x7F800000u) * bc(0x1p-10f);
  vf ulp = select(spacing > bc(0x1p-24f), spacing, bc(0x1p-24f));
  vf frac = (ax - at) / ulp;
  vf drawn = (vf)_mm256_floor_ps((__m256)(frac * bc(65536.0f))) + (vf)_mm256_cvtepi32_ps((__m256i)noise);
  vf r = select(drawn >= bc(65536.0f), at + ulp, at);
  return select(x != x, x, (vf)((vu)r | ((vu)x & sign_bit)));
}

// ``x`` rounded to the nearest value of DT (ties to even), still as fp32.
template <int DT> static inline vf round_to(vf x) {
  if constexpr (DT == BF16) return round_bf16(x);
  else if constexpr (DT == F16) return round_f16(x);
  else return x;
}

// Store values that are already representable in DT (so the conversion is exact).
template <int DT> static inline void store(void *base, int64_t i, vf lo, vf hi) {
  if constexpr (DT == BF16) {
    vu x = ((vu)hi & 0xFFFF0000u) | ((vu)lo >> 16);
    memcpy((uint16_t *)base + i, &x, 32);
  } else {
    vf a, b;
    interleave(lo, hi, a, b);
    if constexpr (DT == F16) {
      __m128i *p = (__m128i *)((uint16_t *)base + i);
      _mm_storeu_si128(p, _mm256_cvtps_ph((__m256)a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      _mm_storeu_si128(p + 1, _mm256_cvtps_ph((__m256)b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
      memcpy((float *)base + i, &a, 32);
      memcpy((float *)base + i + 8, &b, 32);
    }
  }
}

// ---- counter-based random bits (lowp/optim/randomness.py) ---------------------------------------
// random16(i, key) = hash32(lo32(i) ^ key ^ hash32(hi32(i))) >> 16. The key with the high half
// folded in is computed per block on the host side of the vectors (scalar_hash32); hash32's last
// xor-shift leaves the top 16 bits alone, so random16 skips it.
static inline uint32_t scalar_hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

static inline vu random16(vu x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x >> 16;
}

// ---- the optimizer rules (lowp/optim/kernels/rules.py; ``r`` is h[1:]) -------------------------
// The step's numbers h[1:] (computed on the host in float64), as fp32 scalars and broadcast once
// per work unit (not per block); for a lerp with weight r[j], the coefficient (w or w - 1) and
// whether it starts from ``start``; StableAdamW's per-tensor step and decay factors.
struct Numbers {
  double d[9];
  float r[9];
  vf v[9], lerp_coef[9], tensor_step, tensor_decay;
  vi lerp_from_start[9];
  void set(const double *h) {
    for (int j = 0; j < 9; j++) {
      d[j] = h[j];
      r[j] = (float)h[j];
      v[j] = bc(r[j]);
      lerp_coef[j] = bc(r[j] < 0.5f ? r[j] : r[j] - 1.0f);
      lerp_from_start[j] = (vi){} - (r[j] < 0.5f ? 1 : 0);
    }
  }
};

// ATen's vectorised CPU lerp with weight w = r[j]: fma(w, end - start, start) for w < 0.5, else
// fma(w - 1, end - start, end); the choice is made once per call (a blend, no branch per block).
static inline vf lerp(const Numbers &n, vf start, vf end, int j) {
  return fma_(n.lerp_coef[j], end - start, select(n.lerp_from_start[j], start, end));
}

static inline vf maximum(vf a, vf b) { return select((a != a) | (a > b), a, b); }  // NaN propagates

static inline vf sign(vf x) {  // torch.sign: NaN gives 0 (both compares are false)
  return select(x > 0.0f, bc(1.0f), select(x < 0.0f, bc(-1.0f), bc(0.0f)));
}

static inline vf rule(const Numbers &n, vf w, vf g, const vf *s, vf *out) {
  const float *r = n.r;
  const vf *c = n.v;
  if constexpr (RULE == ADAM) {  // cfg = (amsgrad, decoupled, has_wd)
    if constexpr (CFG[2] && !CFG[1]) g = fma_(w, c[7], g);
    vf m = lerp(n, s[0], g, 0);
    vf v = fma_(c[2] * g, g, s[1] * c[1]);
    out[0] = m;
    out[1] = v;
    vf second = v;
    if constexpr (CFG[0]) {
      second = maximum(s[2], v);
      out[2] = second;
    }
    vf u = m / (sqrt_(second) / c[3] + c[4]) * c[5];
    if constexpr (CFG[2] && CFG[1]) u = fma_(w, c[6], u);
    return u;
  } else if constexpr (RULE == SGD) {  // cfg = (has_momentum, nesterov, has_wd)
    vf d = CFG[2] ? fma_(w, c[0], g) : g;
    if constexpr (CFG[0]) {
      vf b = r[3] > 0.0f ? d : fma_(d, c[2], s[0] * c[1]);
      out[0] = b;
      d = CFG[1] ? fma_(b, c[1], d) : b;
    }
    return d * c[4];
  } else if constexpr (RULE == LION) {  // cfg = (has_wd,)
    vf u = sign(lerp(n, s[0], g, 0));
    if constexpr (CFG[0]) u = fma_(w, c[1], u);
    out[0] = lerp(n, s[0], g, 3);
    return u * c[2];
  } else if constexpr (RULE == STABLE) {  // cfg = (has_wd,); lr_t per tensor (see stable_scales)
    vf m = lerp(n, s[0], g, 0);
    vf v = fma_(c[2] * g, g, s[1] * c[1]);
    out[0] = m;
    out[1] = v;
    vf u = m / (sqrt_(v / c[3]) + c[4]) * n.tensor_step;
    if constexpr (CFG[0]) u = fma_(w, n.tensor_decay, u);
    return u;
  } else {  // RADAM, cfg = (has_wd, decoupled)
    if constexpr (CFG[0] && !CFG[1]) g = fma_(w, c[8], g);
    vf m = lerp(n, s[0], g, 0);
    vf v = fma_(c[2] * g, g, s[1] * c[1]);
    out[0] = m;
    out[1] = v;
    vf u = m * c[3];
    if (r[4] > 0.0f) u = u / (sqrt_(v) + c[5]) * c[6];
    if constexpr (CFG[0] && CFG[1]) u = fma_(w, c[7], u);
    return u;
  }
}

// ---- one block of 16 elements: load, rule, state stores, write-back ----------------------------
struct Pointers {
  void *w, *g, *b, *s[3];
};

// Streams of lowp.optim.randomness.Stream: the weight's, the compensation's, then one per state.
enum StreamId { WEIGHT_STREAM = 0, COMPENSATION_STREAM = 1, STATE_STREAM = 2, STREAMS = 5 };

// The random streams of one block of 16 elements: the low 32 bits of the global index of the
// even and odd lanes, and per stream the key with the high 32 bits folded in (per lane: a block
// may straddle a multiple of 2^32).
struct Rng {
  vu lo[2];
  vu key[2][STREAMS];
  template <int S> inline vu bits(int h) const { return random16(lo[h] ^ key[h][S]); }
};

// Which streams a variant draws from (the others' keys are never formed).
constexpr bool USED[STREAMS] = {MODE == STOCHASTIC, MODE == KAHAN && BT != F32,
                                SR && NSTATES > 0 && ST[0] != F32, SR && NSTATES > 1 && ST[1] != F32,
                                SR && NSTATES > 2 && ST[2] != F32};

// The streams of one tensor: its keys (stream_key per stream) and, cached for the current high
// 32 bits ``hi`` of the index, the folded keys for ``hi`` and ``hi + 1``.
struct TensorStreams {
  const uint32_t *keys;
  uint64_t hi = ~0ull;
  uint32_t k0[STREAMS] = {}, k1[STREAMS] = {};

  // The Rng of the block whose element 0 has global index ``first``.
  inline Rng at(uint64_t first) {
    if ((first >> 32) != hi) {
      hi = first >> 32;
      for (int s = 0; s < STREAMS; s++)
        if (USED[s]) {
          k0[s] = keys[s] ^ scalar_hash32((uint32_t)hi);
          k1[s] = keys[s] ^ scalar_hash32((uint32_t)(hi + 1));
        }
    }
    const uint32_t lo = (uint32_t)first;
    const vu even = {0, 2, 4, 6, 8, 10, 12, 14};
    Rng r;
    r.lo[0] = even + lo;
    r.lo[1] = even + (lo + 1u);
    if (__builtin_expect(lo <= 0xFFFFFFF0u, 1)) {  // the block stays below the next multiple of 2^32
      for (int h = 0; h < 2; h++)
        for (int s = 0; s < STREAMS; s++)
          if (USED[s]) r.key[h][s] = bcu(k0[s]);
      return r;
    }
    for (int h = 0; h < 2; h++) {
      const vu wrapped = (vu)(r.lo[h] < bcu(lo));  // lanes past a multiple of 2^32
      for (int s = 0; s < STREAMS; s++)
        if (USED[s]) r.key[h][s] = bcu(k0[s]) ^ (wrapped & bcu(k0[s] ^ k1[s]));
    }
    return r;
  }
};

// ``x`` rounded stochastically to DT with 16 random bits (a plain fp32 value stays itself).
template <int DT> static inline vf stochastic_to(vf x, vu noise) {
  if constexpr (DT == BF16) return stochastic_bf16(x, noise);
  else if constexpr (DT == F16) return stochastic_f16(x, noise);
  else return x;
}

// The stored value of new state J: stochastic rounding for 16-bit states when asked, else nearest.
template <int J> static inline vf state_value(vf x, const Rng &rng, int h) {
  if constexpr (SR && ST[J] != F32) return stochastic_to<ST[J]>(x, rng.bits<STATE_STREAM + J>(h));
  else return round_to<ST[J]>(x);
}

// The weight of 16 elements as (even, odd) fp32 vectors; in exact mode the bf16 weight plus its
// int16 remainder, which is the fp32 weight bit for bit.
static inline void load_weight(const Pointers &p, int64_t i, vf w[2]) {
  if constexpr (MODE == EXACT) {
    vu top, rem;
    memcpy(&top, (const uint16_t *)p.w + i, 32);
    memcpy(&rem, (const uint16_t *)p.b + i, 32);
    w[0] = (vf)((top << 16) + (vu)(((vi)rem << 16) >> 16));
    w[1] = (vf)((top & 0xFFFF0000u) + (vu)((vi)rem >> 16));
  } else {
    load<WT>(p.w, i, w[0], w[1]);
  }
}

// Pass 1 over 16 elements: load, rule, state stores; returns the update ``u`` (even, odd).
static inline void update_block(const Pointers &p, int64_t i, const Numbers &n, const vf &factor, const Rng &rng,
                                vf u[2]) {
  vf w[2], g[2], s[2][3], out[2][3];
  load<GT>(p.g, i, g[0], g[1]);
  load_weight(p, i, w);
  if constexpr (NSTATES > 0) load<ST[0]>(p.s[0], i, s[0][0], s[1][0]);
  if constexpr (NSTATES > 1) load<ST[1]>(p.s[1], i, s[0][1], s[1][1]);
  if constexpr (NSTATES > 2) load<ST[2]>(p.s[2], i, s[0][2], s[1][2]);
  for (int h = 0; h < 2; h++) u[h] = rule(n, w[h], g[h] * factor, s[h], out[h]);

  if constexpr (NSTATES > 0)
    store<ST[0]>(p.s[0], i, state_value<0>(out[0][0], rng, 0), state_value<0>(out[1][0], rng, 1));
  if constexpr (NSTATES > 1)
    store<ST[1]>(p.s[1], i, state_value<1>(out[0][1], rng, 0), state_value<1>(out[1][1], rng, 1));
  if constexpr (NSTATES > 2)
    store<ST[2]>(p.s[2], i, state_value<2>(out[0][2], rng, 0), state_value<2>(out[1][2], rng, 1));
}

// StableAdamW's pre-pass over 16 elements: the sum of g^2 / max(v_hat, eps^2) over the valid
// lanes, with v_hat = v' / bc2 and v' the new second moment (recomputed, not stored).
static inline double stable_block(const Pointers &p, int64_t i, const Numbers &n, const vf &factor, const vi *valid) {
  vf g[2], v[2];
  load<GT>(p.g, i, g[0], g[1]);
  load<ST[1]>(p.s[1], i, v[0], v[1]);
  vf sum = {};
  for (int h = 0; h < 2; h++) {
    vf gh = g[h] * factor;
    vf v_hat = fma_(n.v[2] * gh, gh, v[h] * n.v[1]) / n.v[3];
    sum += select(valid[h], (gh * gh) / maximum(v_hat, n.v[8]), bc(0.0f));
  }
  double total = 0;
  for (int l = 0; l < 8; l++) total += sum[l];
  return total;
}

// Pass 2 over 16 elements: the write-back of lowp/optim/kernels/step.py. A lane is stalled when
// its stored weight did not change (the update was lost to rounding, or zero), as in
// lowp/optim/writeback.py; ``valid`` marks the lanes inside the tensor (all but a tail block's
// padding), the only ones that may count; a stalled lane adds -1 to ``stalled``.
static inline void write_back_block(const Pointers &p, int64_t i, const Rng &rng, const vf u[2],
                                    const vi *valid, vi &stalled) {
  vf w[2], neww[2];
  vi still[2];
  load_weight(p, i, w);
  if constexpr (MODE == KAHAN) {
    vf b[2], newb[2];
    load<BT>(p.b, i, b[0], b[1]);
    for (int h = 0; h < 2; h++) {
      vf v = b[h] + u[h];
      neww[h] = round_to<WT>(w[h] + v);
      vf change = neww[h] - w[h];
      newb[h] = stochastic_to<BT>(v - change, rng.bits<COMPENSATION_STREAM>(h));
      still[h] = change == 0.0f;
    }
    store<BT>(p.b, i, newb[0], newb[1]);
  } else if constexpr (MODE == EXACT) {
    vi top[2], rem[2];
    for (int h = 0; h < 2; h++) {
      vi x = (vi)(w[h] + u[h]);
      top[h] = (x + 0x8000) >> 16;
      rem[h] = x - (top[h] << 16);
      still[h] = (vi){};
    }
    vu pw = ((vu)top[1] << 16) | ((vu)top[0] & 0xFFFFu), pr = ((vu)rem[1] << 16) | ((vu)rem[0] & 0xFFFFu);
    memcpy((uint16_t *)p.w + i, &pw, 32);
    memcpy((uint16_t *)p.b + i, &pr, 32);
  } else {
    for (int h = 0; h < 2; h++) {
      if constexpr (MODE == STOCHASTIC)
        neww[h] = stochastic_to<WT>(w[h] + u[h], rng.bits<WEIGHT_STREAM>(h));
      else
        neww[h] = round_to<WT>(w[h] + u[h]);
      still[h] = neww[h] == w[h];
    }
  }
  if constexpr (MODE != EXACT) store<WT>(p.w, i, neww[0], neww[1]);
  if constexpr (COUNT) stalled += (still[0] & valid[0]) + (still[1] & valid[1]);
}

// ---- the driver: tensors cut into units, units shared by threads -------------------------------
static constexpr int64_t UNIT = 1 << 15;  // elements per work unit
#ifndef LOWP_GROUP
#define LOWP_GROUP 256
#endif
static constexpr int64_t GROUP = LOWP_GROUP;  // elements per two-pass group (a multiple of 16)

static int itemsize(int dt) { return dt == F32 ? 4 : 2; }

struct Task {
  int64_t tensors;
  void *const *ptrs;       // [role][tensor]: weight, grad, buffer, state 0..2
  const int64_t *numel;    // [tensor]
  const int64_t *offset;   // [tensor] global index of element 0 (random streams)
  const uint32_t *keys;    // [tensor][stream] stream keys
  std::vector<int64_t> first_unit;  // [tensor + 1] cumulative unit counts
  Numbers n;
  float factor;
  std::atomic<int64_t> next{0};
  std::vector<float> tensor_step, tensor_decay;  // StableAdamW: -lr_t / bc1 and -lr_t * wd per tensor
};

static Pointers pointers_at(const Task &t, int64_t tensor) {
  Pointers p;
  p.w = t.ptrs[0 * t.tensors + tensor];
  p.g = t.ptrs[1 * t.tensors + tensor];
  p.b = t.ptrs[2 * t.tensors + tensor];
  for (int j = 0; j < 3; j++) p.s[j] = t.ptrs[(3 + j) * t.tensors + tensor];
  return p;
}

// The last ``count`` (< 16) elements of a tensor: copied into zero-padded local blocks, run
// through ``fn(local pointers, valid lanes)``, and (WRITE) the written ones copied back.
template <bool WRITE, typename Fn> static void tail(const Pointers &p, int64_t i, int64_t count, Fn fn) {
  alignas(32) unsigned char local[6][64] = {};
  Pointers q;
  void **src[6] = {&q.w, &q.g, &q.b, &q.s[0], &q.s[1], &q.s[2]};
  void *const orig[6] = {p.w, p.g, p.b, p.s[0], p.s[1], p.s[2]};
  const int types[6] = {MODE == EXACT ? BF16 : WT, GT, MODE == EXACT ? I16 : BT, ST[0], ST[1], ST[2]};
  for (int r = 0; r < 6; r++) {
    *src[r] = local[r];
    if (orig[r]) memcpy(local[r], (char *)orig[r] + i * itemsize(types[r]), count * itemsize(types[r]));
  }
  vi valid[2] = {};
  for (int h = 0; h < 2; h++)
    for (int l = 0; l < 8; l++) valid[h][l] = (2 * l + h < count) ? -1 : 0;
  fn(q, valid);
  for (int r = 0; r < 6 && WRITE; r++)
    if (orig[r] && r != 1) memcpy((char *)orig[r] + i * itemsize(types[r]), local[r], count * itemsize(types[r]));
}

static const vi ALL_VALID[2] = {(vi){} - 1, (vi){} - 1};

// StableAdamW's pre-pass: partial[unit] = the unit's sum (threads share units; the sums are added
// per tensor in unit order afterwards, so the result does not depend on the thread count).
static void stable_sums(Task *t, std::vector<double> &partial) {
  const vf factor = bc(t->factor);
  int64_t tensor = 0, units = t->first_unit[t->tensors];
  for (int64_t unit; (unit = t->next.fetch_add(1)) < units;) {
    while (t->first_unit[tensor + 1] <= unit) tensor++;
    const Pointers p = pointers_at(*t, tensor);
    const int64_t start = (unit - t->first_unit[tensor]) * UNIT;
    const int64_t end = start + UNIT < t->numel[tensor] ? start + UNIT : t->numel[tensor];
    double sum = 0;
    int64_t i = start;
    for (; i + 16 <= end; i += 16) sum += stable_block(p, i, t->n, factor, ALL_VALID);
    if (i < end)
      tail<false>(p, i, end - i, [&](const Pointers &q, const vi *valid) { sum += stable_block(q, 0, t->n, factor, valid); });
    partial[unit] = sum;
  }
}

// lr_t = lr / max(1, RMS) per tensor, RMS = sqrt(mean) in fp32 as the reference computes it
// (lowp/optim/stableadamw.py); h = [1-b1, b2, 1-b2, bc2, eps, lr, bc1, wd, eps^2].
static void stable_scales(Task &t, const std::vector<double> &partial) {
  t.tensor_step.resize(t.tensors);
  t.tensor_decay.resize(t.tensors);
  for (int64_t j = 0; j < t.tensors; j++) {
    double sum = 0;
    for (int64_t unit = t.first_unit[j]; unit < t.first_unit[j + 1]; unit++) sum += partial[unit];
    float rms = __builtin_sqrtf((float)(sum / (double)t.numel[j]));
    double lr_t = t.n.d[5] / (rms > 1.0f ? (double)rms : 1.0);
    t.tensor_step[j] = (float)(-lr_t / t.n.d[6]);
    t.tensor_decay[j] = (float)(-lr_t * t.n.d[7]);
  }
}

static int64_t work(Task *t) {
  const vi *valid = ALL_VALID;
  const vf factor = bc(t->factor);
  int64_t total = 0, tensor = 0, units = t->first_unit[t->tensors];
  Numbers n = t->n;
  for (int64_t unit; (unit = t->next.fetch_add(1)) < units;) {
    while (t->first_unit[tensor + 1] <= unit) tensor++;
    const Pointers p = pointers_at(*t, tensor);
    const int64_t start = (unit - t->first_unit[tensor]) * UNIT;
    const int64_t end = start + UNIT < t->numel[tensor] ? start + UNIT : t->numel[tensor];
    if constexpr (RULE == STABLE) {
      n.tensor_step = bc(t->tensor_step[tensor]);
      n.tensor_decay = bc(t->tensor_decay[tensor]);
    }
    vi stalled = {};
    int64_t i = start;
    TensorStreams streams{t->keys + tensor * STREAMS};
    const uint64_t base = (uint64_t)t->offset[tensor];  // global index of local element 0
    // Two passes per group of GROUP elements (their updates wait in L1): each pass has a shorter
    // dependency chain than the whole step, so the core overlaps more blocks (measured faster).
    for (; i + GROUP <= end; i += GROUP) {
      vf u[GROUP / 16][2];
      for (int64_t j = 0; j < GROUP; j += 16)
        update_block(p, i + j, n, factor, streams.at(base + i + j), u[j / 16]);
      for (int64_t j = 0; j < GROUP; j += 16)
        write_back_block(p, i + j, streams.at(base + i + j), u[j / 16], valid, stalled);
    }
    for (; i + 16 <= end; i += 16) {
      vf u[2];
      const Rng rng = streams.at(base + i);
      update_block(p, i, n, factor, rng, u);
      write_back_block(p, i, rng, u, valid, stalled);
    }
    if (i < end)
      tail<true>(p, i, end - i, [&](const Pointers &q, const vi *lanes_valid) {
        vf u[2];
        const Rng rng = streams.at(base + i);
        update_block(q, 0, n, factor, rng, u);
        write_back_block(q, 0, rng, u, lanes_valid, stalled);
      });
    for (int l = 0; l < 8; l++) total -= stalled[l];
  }
  return total;
}

// ``offset[j]``: global element index of tensor j's element 0 (its elements are a contiguous
// range of the parameter); ``keys[j * 5 + s]``: stream_key of stream s of tensor j.
extern "C" int64_t lowp_step(int64_t tensors, void *const *ptrs, const int64_t *numel, const int64_t *offset,
                             const double *h, const uint32_t *keys, int threads) {
  Task t;
  t.tensors = tensors;
  t.ptrs = ptrs;
  t.numel = numel;
  t.offset = offset;
  t.first_unit.assign(tensors + 1, 0);
  for (int64_t j = 0; j < tensors; j++) t.first_unit[j + 1] = t.first_unit[j] + (numel[j] + UNIT - 1) / UNIT;
  t.factor = (float)h[0];
  t.n.set(h + 1);
  t.keys = keys;
  int64_t units = t.first_unit[tensors], total = 0;
  int n = threads < 1 ? 1 : (threads > units ? (int)units : threads);
  if (n < 1) n = 1;
  // OpenMP, so that the work runs on torch's own thread pool (the libgomp torch loaded): a pool of
  // our own would compete with torch's workers, which spin for a while after each parallel op.
  if constexpr (RULE == STABLE) {
    std::vector<double> partial(units, 0.0);
#pragma omp parallel num_threads(n)
    stable_sums(&t, partial);
    stable_scales(t, partial);
    t.next = 0;
  }
#pragma omp parallel num_threads(n) reduction(+ : total)
  total += work(&t);
  return total;
}
