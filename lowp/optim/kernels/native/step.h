// lowp fused optimizer step, part 2: blocks of BLOCK elements (load, rule, state stores, write-back)
// and the multi-tensor driver. Included by a generated variant after vector.h and its `rule`
// (lowp/optim/kernels/native/source.py).
//
// Driver: tensors are cut into work units of UNIT elements that torch's OpenMP threads take from
// an atomic counter (parallel.h); within a unit, groups of GROUP elements go through two passes (update_block,
// then write_back_block). A spec with a per-tensor reduction has a second entry point,
// lowp_sums, which the host calls first; it turns the sums into per-tensor numbers (read by the
// rule as `t[j]`). Measurements behind these choices: docs/fused.md.
#pragma once
#include <utility>
#include <vector>

#include "finite.h"
#include "parallel.h"

// Run `f(std::integral_constant<int, J>{})` for every state J (J is a compile-time constant, so
// each state's dtype picks its own load and store).
template <typename F, int... J> static inline void each_state(F &&f, std::integer_sequence<int, J...>) {
  (f(std::integral_constant<int, J>{}), ...);
}
template <typename F> static inline void for_states(F &&f) {
  each_state(f, std::make_integer_sequence<int, NSTATES>{});
}

struct Pointers {
  void *w, *g, *b, *s[NSTATES + 1];
};

// Streams of lowp.optim.randomness.Stream: the weight's, the compensation's, then one per state.
enum StreamId { WEIGHT_STREAM = 0, COMPENSATION_STREAM = 1, STATE_STREAM = 2 };
constexpr int STREAMS = STATE_STREAM + NSTATES;

// Which streams a variant draws from (the others' keys are never formed).
constexpr bool used_stream(int s) {
  if (s == WEIGHT_STREAM) return MODE_WEIGHT_STREAM;
  if (s == COMPENSATION_STREAM) return MODE_COMPENSATION_STREAM;
  return SR && (ST[s - STATE_STREAM] != F32 || coded_state(s - STATE_STREAM));
}

// Per stream the key with the high 32 bits of a block's index folded in (per lane: a block may
// straddle a multiple of 2^32), kept mixed (simd.h's mix16: the streams of a block share the mixing
// of the index); [h][s]: the even (h = 0) or odd lanes of stream s.
struct StreamKeys {
  vu key[2][STREAMS];
};

// The random streams of one block of BLOCK elements: half the low 32 bits of the global index of
// the even and odd lanes (the pairs of random16), and the StreamKeys of the block, which many blocks
// share (an Rng holds them by pointer: copying them with every block cost the step 2-4% of its
// instructions). When the block's first index is even, lane l's two elements are one pair: one hash
// per lane and stream gives both lanes' bits.
struct Rng {
  vu pair[2];
  const StreamKeys *keys;
  bool shared;
  // The 16 random bits of stream S of the even (out[0]) and odd (out[1]) lanes.
  template <int S> inline void bits(vu out[2]) const {
    const vu x = hash32_mixed(mix16(pair[0]) ^ keys->key[0][S]);
    if (__builtin_expect(shared, 1)) {
      out[0] = low16(x);
      out[1] = high16(x);
      return;
    }
    out[0] = high16(x);  // odd elements in the even lanes, even ones in the odd lanes
    out[1] = low16(hash32_mixed(mix16(pair[1]) ^ keys->key[1][S]));
  }
};

// The streams of one tensor: its keys (stream_key per stream), folded with the high half of the
// current block's index (simd.h's FoldedKeys).
struct TensorStreams {
  const uint32_t *keys;
  FoldedKeys<STREAMS> folded;

  // The Rng of the block whose element 0 has global index ``first``, its keys written to ``out``.
  inline Rng at(uint64_t first, StreamKeys &out) {
    folded.fold(keys, first);
    const uint32_t lo = (uint32_t)first;
    vu even;
    for (int l = 0; l < LANES; l++) even[l] = 2 * l;
    const vu lanes[2] = {even + lo, even + (lo + 1u)};
    const Rng r{{lanes[0] >> 1, lanes[1] >> 1}, &out, (first & 1) == 0};
    if (__builtin_expect(lo <= 0xFFFFFFFFu - (BLOCK - 1), 1)) {  // the block stays below the next multiple of 2^32
      for (int h = 0; h < 2; h++)
        for (int s = 0; s < STREAMS; s++)
          if (used_stream(s)) out.key[h][s] = bcu(mix16(folded.k0[s]));
      return r;
    }
    for (int h = 0; h < 2; h++)
      for (int s = 0; s < STREAMS; s++)
        if (used_stream(s)) out.key[h][s] = mix16(folded.wrapped(s, lanes[h], lo));
    return r;
  }
};

// The Rngs of the BLOCK-element blocks of a group of ``span`` elements whose element 0 has global
// index ``first``: one TensorStreams::at for the whole group, whose keys every block shares, unless
// the group crosses a multiple of 2^32 (then each block's own, in ``crossing``: an Rng of such a
// group is valid until the next ``at``). Its Rngs point into it, so it is never copied.
struct GroupRng {
  TensorStreams &streams;
  uint64_t first;
  bool one_half;
  StreamKeys shared, crossing;
  Rng rng0;
  GroupRng(TensorStreams &s, uint64_t first_, int64_t span)
      : streams(s), first(first_), one_half((uint32_t)first_ <= 0xFFFFFFFFu - (uint32_t)(span - 1)),
        rng0(s.at(first_, shared)) {}
  GroupRng(const GroupRng &) = delete;
  GroupRng &operator=(const GroupRng &) = delete;
  // the Rng of the block from group element ``j``
  inline Rng at(int64_t j) {
    if (__builtin_expect(one_half, 1))  // j is a multiple of BLOCK: the pairs move on by j / 2
      return Rng{{rng0.pair[0] + (uint32_t)(j >> 1), rng0.pair[1] + (uint32_t)(j >> 1)}, rng0.keys, rng0.shared};
    return streams.at(first + j, crossing);
  }
};

// ``x`` rounded stochastically to DT with 16 random bits (a plain fp32 value stays itself).
template <int DT> static inline vf stochastic_to(vf x, vu noise) {
  if constexpr (DT == BF16) return stochastic_bf16(x, noise);
  else if constexpr (DT == F16) return stochastic_f16(x, noise);
  else return x;
}

// New state J of a block (even, odd lanes) stored: stochastic rounding for 16-bit states when asked,
// else nearest.
template <int J> static inline void store_state(void *ptr, int64_t i, const vf &even, const vf &odd, const Rng &rng) {
  if constexpr (SR && ST[J] != F32) {
    vu noise[2];
    rng.template bits<STATE_STREAM + J>(noise);
    store<ST[J]>(ptr, i, stochastic_to<ST[J]>(even, noise[0]), stochastic_to<ST[J]>(odd, noise[1]));
  } else {
    store<ST[J]>(ptr, i, round_to<ST[J]>(even), round_to<ST[J]>(odd));
  }
}

// The write-back mode: load_weight(p, i, w), the weight of a block as (even, odd) fp32 vectors
// (with the mode's remainder, if it keeps one), and write_back_lanes(p, i, rng, w, u, still), which
// stores w + u (and the mode's buffer) and sets the lanes whose stored weight did not change.
#include LOWP_MODE_HEADER

// Weight and gradient (times ``factor``) of a block, as (even, odd) fp32 vectors.
static inline void load_weight_and_grad(const Pointers &p, int64_t i, const vf &factor, vf w[2], vf g[2]) {
  load<GT>(p.g, i, g[0], g[1]);
  g[0] *= factor;
  g[1] *= factor;
  load_weight(p, i, w);
}

// Weight, gradient (times ``factor``) and states of a block, as (even, odd) fp32 vectors.
static inline void load_inputs(const Pointers &p, int64_t i, const vf &factor, vf w[2], vf g[2],
                               vf s[2][NSTATES + 1]) {
  load_weight_and_grad(p, i, factor, w, g);
  for_states([&](auto j) {
    constexpr int J = decltype(j)::value;
    load<ST[J]>(p.s[J], i, s[0][J], s[1][J]);
  });
}

// Pass 1 over a block: load, rule, state stores; returns the update ``u`` and the weight ``w`` (even,
// odd), which pass 2 reads back from L1 rather than decoding the weight again (exact8's decode is a
// dozen instructions per vector: about 3% of the 5 bytes/param step, docs/fused.md).
static inline void update_block(const Pointers &p, int64_t i, const rule_uniform &r, const vf &factor,
                                const Rng &rng, vf u[2], vf w[2]) {
  vf g[2], s[2][NSTATES + 1], out[2][NSTATES + 1];
  load_inputs(p, i, factor, w, g, s);
  for (int h = 0; h < 2; h++) u[h] = rule(r, w[h], g[h], s[h], out[h]);
  for_states([&](auto j) {
    constexpr int J = decltype(j)::value;
    store_state<J>(p.s[J], i, out[0][J], out[1][J], rng);
  });
}

// Pass 2 over a block: the write-back mode (lowp/optim/writeback) from pass 1's ``w`` and ``u``. A
// lane is stalled when its stored weight did not change (the update was lost to rounding, or zero);
// ``valid`` marks the lanes inside the tensor (all but a tail block's padding), the only ones that
// may count; a stalled lane adds -1 to ``stalled``.
static inline void write_back_block(const Pointers &p, int64_t i, const Rng &rng, const vf w[2], const vf u[2],
                                    const vi *valid, vi &stalled) {
  vi still[2];
  write_back_lanes(p, i, rng, w, u, still);
  if constexpr (COUNT) stalled += (still[0] & valid[0]) + (still[1] & valid[1]);
}

// ---- the driver: tensors cut into units, units shared by threads -------------------------------
static constexpr int64_t UNIT = 1 << 15;  // elements per work unit
static constexpr int64_t GROUP = 256;     // elements per two-pass group (a multiple of BLOCK)
static constexpr int ROLES = 3 + NSTATES;  // weight, gradient, buffer, states

static constexpr int itemsize(int dt) { return dt == F32 ? 4 : dt == I8 ? 1 : 2; }

// What a step call does about non-finite gradients (lowp.optim's ``nonfinite``): nothing (the host
// checked them, or "off"), skip the tensors whose gradient holds a NaN or infinity ("skip_param"),
// or skip the whole call when any does ("skip_step").
enum Check { CHECK_OFF = 0, CHECK_SKIP_PARAM = 1, CHECK_SKIP_STEP = 2 };

// One call: the tensors' pointers, sizes and numbers (the arguments of lowp_step) and their units.
struct Task {
  Units<UNIT> units;
  void *const *ptrs;              // [role][tensor]
  const int64_t *offset;          // [tensor] global index of element 0 (random streams)
  const double *tensor_numbers;   // [tensor][TENSOR_NUMBERS]
  std::vector<uint32_t> keys;     // [tensor][stream] stream keys
  std::vector<std::atomic<uint8_t>> bad;  // [tensor] its gradient holds a non-finite value
  bool check_small = false;       // a one-unit tensor's gradient is checked by the unit that steps it
  Numbers n;
  float factor;

  Task(int64_t count, void *const *p, const int64_t *sizes, const double *h, const int64_t *offsets = nullptr,
       const double *per_tensor = nullptr)
      : units(count, sizes), ptrs(p), offset(offsets), tensor_numbers(per_tensor), bad(count) {
    factor = (float)h[0];
    n.set(h + 1);
    for (auto &b : bad) b.store(0, std::memory_order_relaxed);
  }
  // The stream keys of every tensor at ``step`` (tensor j is parameter ``param_ids[j]``).
  void set_keys(uint64_t seed, uint64_t step, const int64_t *param_ids) {
    keys.resize(units.tensors * STREAMS);
    for (int64_t j = 0; j < units.tensors; j++) stream_keys(seed, step, (uint64_t)param_ids[j], STREAMS, &keys[j * STREAMS]);
  }
  Pointers at(int64_t tensor) const {
    const int64_t tensors = units.tensors;
    Pointers p;
    p.w = ptrs[0 * tensors + tensor];
    p.g = ptrs[1 * tensors + tensor];
    p.b = ptrs[2 * tensors + tensor];
    for (int j = 0; j < NSTATES; j++) p.s[j] = ptrs[(3 + j) * tensors + tensor];
    return p;
  }
};

static int role_type(int role) {
  if (role == 0) return WT;
  if (role == 1) return GT;
  if (role == 2) return BT;  // the exact modes' remainders: I16 / I8 (static_asserts of vector.h)
  return ST[role - 3];
}

// Per role (weight, gradient, buffer, states): ``p``'s pointer and the field of ``q`` that holds it.
static inline void role_table(const Pointers &p, Pointers &q, void *orig[ROLES], void **dst[ROLES]) {
  dst[0] = &q.w, dst[1] = &q.g, dst[2] = &q.b;
  orig[0] = p.w, orig[1] = p.g, orig[2] = p.b;
  for (int j = 0; j < NSTATES; j++) dst[3 + j] = &q.s[j], orig[3 + j] = p.s[j];
}

// The last ``count`` (< BLOCK) elements of a tensor: copied into zero-padded local blocks, run
// through ``fn(local pointers, valid lanes)``, and (WRITE) the written ones copied back.
template <bool WRITE, typename Fn> static void tail(const Pointers &p, int64_t i, int64_t count, Fn fn) {
  alignas(64) unsigned char local[ROLES][4 * BLOCK] = {};
  Pointers q;
  void **dst[ROLES];
  void *orig[ROLES];
  role_table(p, q, orig, dst);
  for (int r = 0; r < ROLES; r++) {
    *dst[r] = local[r];
    if (orig[r]) memcpy(local[r], (char *)orig[r] + i * itemsize(role_type(r)), count * itemsize(role_type(r)));
  }
  vi valid[2] = {};
  for (int h = 0; h < 2; h++)
    for (int l = 0; l < LANES; l++) valid[h][l] = (2 * l + h < count) ? -1 : 0;
  fn(q, valid);
  for (int r = 0; r < ROLES && WRITE; r++)
    if (orig[r] && r != 1) memcpy((char *)orig[r] + i * itemsize(role_type(r)), local[r], count * itemsize(role_type(r)));
}

// ---- software prefetch ----------------------------------------------------------------------
// A unit's group loop asks for the memory of the group PREFETCH_GROUPS ahead (weight, gradient,
// buffer, states: five streams or more, each read in pass 1 or 2 and written back) before it steps
// its own: with the hardware prefetchers alone the step waited on its loads (on a Xeon with AVX-512
// the default AdamW step takes 0.76-0.90x the time with it; docs/fused.md, "Software prefetch").
// The helpers are always inlined: GCC deleted an out-of-line call whose only effects were
// prefetches (its IPA treats such a function as free of side effects).

static constexpr int64_t PREFETCH_GROUPS = 2;

// Ask for the ``bytes`` from ``base + offset``, for writing when RW (one request per 64-byte line).
template <int RW> __attribute__((always_inline)) static inline void prefetch_bytes(const void *base, int64_t offset, int64_t bytes) {
  const char *a = (const char *)base + offset;
#pragma GCC unroll 16
  for (int64_t k = 0; k < bytes; k += 64) __builtin_prefetch(a + k, RW, 3);
}

// Byte offsets of a plain state's elements: ``of<J>(i)`` (coded_step.h's CodedBytes adds codes).
struct PlainBytes {
  template <int J> static constexpr int64_t of(int64_t i) { return i * itemsize(ST[J]); }
};

// Prefetch elements [i, i + COUNT) of states J, J + 1, ... of ``p`` (for_states' lambda is not
// always inlined, and a call of it that only prefetches was deleted like prefetch_group's).
template <int64_t COUNT, typename Bytes, int J = 0>
__attribute__((always_inline)) static inline void prefetch_states(const Pointers &p, int64_t i) {
  if constexpr (J < NSTATES) {
    prefetch_bytes<1>(p.s[J], Bytes::template of<J>(i), Bytes::template of<J>(COUNT));
    prefetch_states<COUNT, Bytes, J + 1>(p, i);
  }
}

// Prefetch elements [i, i + COUNT) of every role of ``p`` (the gradient for reading, the others for
// writing: the step writes them back); ``Bytes::of<J>``: state J's byte offsets.
template <int64_t COUNT, typename Bytes = PlainBytes>
__attribute__((always_inline)) static inline void prefetch_group(const Pointers &p, int64_t i) {
  prefetch_bytes<0>(p.g, i * itemsize(GT), COUNT * itemsize(GT));
  prefetch_bytes<1>(p.w, i * itemsize(WT), COUNT * itemsize(WT));
  if (p.b) prefetch_bytes<1>(p.b, i * itemsize(BT), COUNT * itemsize(BT));
  prefetch_states<COUNT, Bytes>(p, i);
}

static const vi ALL_VALID[2] = {(vi){} - 1, (vi){} - 1};

// One work unit: elements [start, end) of the tensor at ``p`` (indexed from its element 0, whose
// global index is ``base``); stalled lanes add -1 to ``stalled``.
static inline void step_unit(const Pointers &p, int64_t start, int64_t end, uint64_t base, TensorStreams &streams,
                             const rule_uniform &r, const vf &factor, vi &stalled) {
  const vi *valid = ALL_VALID;
  int64_t i = start;
  // Two passes per group of GROUP elements (their updates wait in L1): each pass has a shorter
  // dependency chain than the whole step, so the core overlaps more blocks (measured faster).
  for (; i + GROUP <= end; i += GROUP) {
    if (i + (PREFETCH_GROUPS + 1) * GROUP <= end) prefetch_group<GROUP>(p, i + PREFETCH_GROUPS * GROUP);
    vf u[GROUP / BLOCK][2], w[GROUP / BLOCK][2];
    GroupRng rng(streams, base + i, GROUP);  // for both passes
    for (int64_t j = 0; j < GROUP; j += BLOCK) update_block(p, i + j, r, factor, rng.at(j), u[j / BLOCK], w[j / BLOCK]);
    for (int64_t j = 0; j < GROUP; j += BLOCK)
      write_back_block(p, i + j, rng.at(j), w[j / BLOCK], u[j / BLOCK], valid, stalled);
  }
  for (; i + BLOCK <= end; i += BLOCK) {
    vf u[2];
    StreamKeys keys;
    const Rng rng = streams.at(base + i, keys);
    vf w[2];
    update_block(p, i, r, factor, rng, u, w);
    write_back_block(p, i, rng, w, u, valid, stalled);
  }
  if (i < end)
    tail<true>(p, i, end - i, [&](const Pointers &q, const vi *lanes_valid) {
      vf u[2];
      StreamKeys keys;
      const Rng rng = streams.at(base + i, keys);
      vf w[2];
      update_block(q, 0, r, factor, rng, u, w);
      write_back_block(q, 0, rng, w, u, lanes_valid, stalled);
    });
}

// The units of ``t`` taken from its counter until none is left, each through ``unit(tensor, p,
// start, end, base, streams, r, factor, stalled)`` (step_unit's arguments after the tensor's
// index), skipping the tensors whose gradient is non-finite; returns the stalled count.
template <typename F> static int64_t work_units(Task *t, F &&unit) {
  const vf factor = bc(t->factor);
  int64_t total = 0;
  const Numbers n = t->n;
  vf tn[TENSOR_NUMBERS + 1];
  for (Unit u; t->units.take(u);) {
    const int64_t tensor = u.tensor;
    const Pointers p = t->at(tensor);
    if (t->bad[tensor].load(std::memory_order_relaxed)) continue;
    if (t->check_small && t->units.numel[tensor] <= UNIT && any_nonfinite(p.g, GT, 0, t->units.numel[tensor])) {
      t->bad[tensor].store(1, std::memory_order_relaxed);  // its only unit: nothing of it was written
      continue;
    }
    for (int j = 0; j < TENSOR_NUMBERS; j++) tn[j] = bc((float)t->tensor_numbers[tensor * TENSOR_NUMBERS + j]);
    rule_uniform r;  // the rule's values that are the same for every element: once per unit
    rule_prepare(n, tn, r);
    vi stalled = {};
    TensorStreams streams{&t->keys[tensor * STREAMS]};
    unit(tensor, p, u.start, u.end, (uint64_t)t->offset[tensor], streams, r, factor, stalled);
    for (int l = 0; l < LANES; l++) total -= stalled[l];
  }
  return total;
}

// The non-finite pre-pass of ``check`` (CHECK_SKIP_PARAM: the tensors of more than one unit, whose
// units may run on several threads, all before any is written; CHECK_SKIP_STEP: every tensor),
// marking ``t.bad``; then whether the step goes on (under CHECK_SKIP_STEP: every gradient finite).
static bool check_gradients(Task &t, int check, int threads) {
  if (check == CHECK_OFF) return true;
  const int64_t tensors = t.units.tensors;
  std::vector<int64_t> sizes(tensors);
  for (int64_t j = 0; j < tensors; j++)
    sizes[j] = check == CHECK_SKIP_STEP || t.units.numel[j] > UNIT ? t.units.numel[j] : 0;
  Units<UNIT> pre(tensors, sizes.data());
  if (pre.count() > 0) {
#pragma omp parallel num_threads(thread_count(threads, pre.count()))
    for (Unit u; pre.take(u);)
      if (!t.bad[u.tensor].load(std::memory_order_relaxed) &&
          any_nonfinite(t.ptrs[tensors + u.tensor], GT, u.start, u.end - u.start))
        t.bad[u.tensor].store(1, std::memory_order_relaxed);
  }
  t.check_small = check == CHECK_SKIP_PARAM;
  if (check == CHECK_SKIP_STEP)
    for (int64_t j = 0; j < tensors; j++)
      if (t.bad[j].load()) return false;
  return true;
}

// The whole step of ``t`` on ``threads`` OpenMP threads, each unit through ``unit`` (work_units),
// after the non-finite ``check`` (check_gradients); ``finite[j]`` (when not null) is set to whether
// tensor j's gradient was finite (1 under CHECK_OFF). Returns the stalled count. OpenMP, so that
// the work runs on torch's own thread pool (the libgomp torch loaded): a pool of our own would
// compete with torch's workers, which spin for a while after each parallel op.
template <typename F> static int64_t run_units(Task &t, int threads, int check, uint8_t *finite, F &&unit) {
  int64_t total = 0;
  if (check_gradients(t, check, threads)) {
#pragma omp parallel num_threads(thread_count(threads, t.units.count())) reduction(+ : total)
    total += work_units(&t, unit);
  }
  if (finite)
    for (int64_t j = 0; j < t.units.tensors; j++) finite[j] = !t.bad[j].load();
  return total;
}

#ifndef LOWP_CODE_KINDS   // a coded variant's entry point is coded_step.h's lowp_coded_step
// ``ptrs[role * tensors + j]``: role 0 weight, 1 gradient, 2 buffer (or null), 3 + k state k;
// ``offset[j]``: global element index of tensor j's element 0 (its elements are a contiguous range
// of the parameter); ``h``: the gradient factor, then the spec's numbers; ``tensor_numbers[j * T +
// k]``: per-tensor number k of tensor j; ``seed``, ``step`` and ``param_ids[j]`` (tensor j's
// parameter) make the stream keys (stream_keys); ``check`` (enum Check) and ``finite`` (null, or
// one flag per tensor) as run_units.
extern "C" int64_t lowp_step(int64_t tensors, void *const *ptrs, const int64_t *numel, const int64_t *offset,
                             const double *h, const double *tensor_numbers, uint64_t seed, uint64_t step,
                             const int64_t *param_ids, int check, uint8_t *finite, int threads) {
  Task t(tensors, ptrs, numel, h, offset, tensor_numbers);
  t.set_keys(seed, step, param_ids);
  return run_units(t, threads, check, finite, [](int64_t, const Pointers &p, int64_t start, int64_t end, uint64_t base,
                                                 TensorStreams &streams, const rule_uniform &r, const vf &factor,
                                                 vi &stalled) {
    step_unit(p, start, end, base, streams, r, factor, stalled);
  });
}
#endif

#if LOWP_REDUCTION
// The per-tensor pre-pass: ``sums[j]`` = the sum over tensor j of the spec's reduction term, in the
// order of lowp/optim/ordered_sum.py: the two elements of a lane (even, odd) add in fp32, the 8 lanes
// of a 16-element block in float64 into the block's total, the blocks' totals in float64 per unit,
// units in unit order per tensor (so the result depends neither on the thread count nor on the
// vector width: a 32-element block of the 512-bit build adds as two 16-element ones).
template <typename Put>
static inline void reduction_block(const Pointers &p, int64_t i, const reduction_uniform &r, const vf &factor,
                                   const vi *valid, Put &&put) {
  vf w[2], g[2], s[2][NSTATES + 1];
  load_inputs(p, i, factor, w, g, s);
  vf pairs = {};
  for (int h = 0; h < 2; h++) pairs += select(valid[h], reduction(r, w[h], g[h], s[h]), bc(0.0f));
  for (int first = 0; first < LANES && valid[0][first]; first += 8) {  // each 16 elements holding one of the tensor
    double total = 0;
    for (int l = first; l < first + 8; l++) total += pairs[l];
    put(total);
  }
}

// ``put(total)`` of every 16-element block of the elements [start, end) of ``p`` in block order
// (``start`` at a block's first element; the last block zero-padded past ``end``).
template <typename Put>
static inline void reduction_blocks(const Pointers &p, int64_t start, int64_t end, const reduction_uniform &r,
                                    const vf &factor, Put &&put) {
  int64_t i = start;
  for (; i + BLOCK <= end; i += BLOCK) reduction_block(p, i, r, factor, ALL_VALID, put);
  if (i < end)
    tail<false>(p, i, end - i, [&](const Pointers &q, const vi *valid) { reduction_block(q, 0, r, factor, valid, put); });
}

extern "C" void lowp_sums(int64_t tensors, void *const *ptrs, const int64_t *numel, const double *h, double *sums,
                          int threads) {
  Task t(tensors, ptrs, numel, h);
  std::vector<double> partial(t.units.count(), 0.0);
#pragma omp parallel num_threads(thread_count(threads, t.units.count()))
  {
    const vf factor = bc(t.factor);
    reduction_uniform r;
    reduction_prepare(t.n, nullptr, r);
    for (Unit u; t.units.take(u);) {
      double sum = 0;
      reduction_blocks(t.at(u.tensor), u.start, u.end, r, factor, [&](double block) { sum += block; });
      partial[u.index] = sum;
    }
  }
  for (int64_t j = 0; j < tensors; j++) {
    double sum = 0;
    for (int64_t unit = t.units.first[j]; unit < t.units.first[j + 1]; unit++) sum += partial[unit];
    sums[j] = sum;
  }
}

// The elements of ordered_sum.py's pieces: a term, a 16-element block, a unit (PIECE_SIZE).
constexpr int64_t PIECE_TERM = 1, PIECE_BLOCK = 16;

// The pieces of lowp/optim/ordered_sum.py, a run at a time: tensor j (a run of a shard: its
// pointers at the run's first element) is cut into pieces of ``size[j]`` elements (PIECE_TERM,
// PIECE_BLOCK or UNIT, checked by the host; the last piece may be shorter), and the sum of each
// piece (the term itself, the block's sum, the unit's sum: each from +0.0, in the order of
// lowp_sums) is written in piece order, the runs' pieces one after the other from ``sums[0]``.
extern "C" void lowp_piece_sums(int64_t tensors, void *const *ptrs, const int64_t *numel, const int64_t *size,
                                const double *h, double *sums, int threads) {
  Task t(tensors, ptrs, numel, h);
  std::vector<int64_t> first(tensors + 1, 0);  // [run] its first piece in ``sums``
  for (int64_t j = 0; j < tensors; j++) first[j + 1] = first[j] + (numel[j] + size[j] - 1) / size[j];
#pragma omp parallel num_threads(thread_count(threads, t.units.count()))
  {
    const vf factor = bc(t.factor);
    reduction_uniform r;
    reduction_prepare(t.n, nullptr, r);
    for (Unit u; t.units.take(u);) {
      const Pointers p = t.at(u.tensor);
      double *out = sums + first[u.tensor] + u.start / size[u.tensor];
      if (size[u.tensor] == UNIT) {
        double sum = 0;
        reduction_blocks(p, u.start, u.end, r, factor, [&](double block) { sum += block; });
        *out = sum;
      } else if (size[u.tensor] == PIECE_BLOCK) {
        reduction_blocks(p, u.start, u.end, r, factor, [&](double block) { *out++ = block; });
      } else {  // PIECE_TERM: each element a block of its own, its lane's other element zero
        for (int64_t i = u.start; i < u.end; i++)
          reduction_blocks(p, i, i + 1, r, factor, [&](double term) { *out++ = term; });
      }
    }
  }
}
#endif
