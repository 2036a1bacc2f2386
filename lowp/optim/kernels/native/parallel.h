// lowp native kernels: many tensors cut into work units that torch's OpenMP threads take from an
// atomic counter (the step of step.h, the codec of codes.cpp, the gradient check of finite.cpp).
// Nothing here depends on a variant's macros.
//
// Tensor k of numel[k] elements holds ceil(numel[k] / UNIT) units: unit u of the whole call lies
// in the tensor k with first[k] <= u < first[k + 1] (first: the cumulative unit counts) and covers
// its elements [(u - first[k]) * UNIT, min((u - first[k] + 1) * UNIT, numel[k])). The counter
// hands units out in increasing order, so each thread's tensor index only moves forward.
#pragma once
#include <stdint.h>

#include <atomic>
#include <vector>

// The OpenMP threads to start for ``units`` work units: ``threads`` (at least 1), at most one per unit.
static inline int thread_count(int threads, int64_t units) {
  int n = threads < 1 ? 1 : (threads > units ? (int)units : threads);
  return n < 1 ? 1 : n;
}

// One unit taken from the counter: its index in the call, its tensor and its element range
// [start, end). Start from ``Unit{}``; the next take moves ``tensor`` forward from where it is.
struct Unit {
  int64_t index = 0, tensor = 0, start = 0, end = 0;
};

// The units of ``tensors`` tensors of ``numel`` elements, UNIT elements each (a tensor's last
// unit may be shorter), and the counter the threads take them from.
template <int64_t UNIT> struct Units {
  int64_t tensors;
  const int64_t *numel;
  std::vector<int64_t> first;  // [tensor + 1] cumulative unit counts
  std::atomic<int64_t> next{0};

  Units(int64_t count, const int64_t *sizes) : tensors(count), numel(sizes) {
    first.assign(tensors + 1, 0);
    for (int64_t k = 0; k < tensors; k++) first[k + 1] = first[k] + (numel[k] + UNIT - 1) / UNIT;
  }
  int64_t count() const { return first[tensors]; }
  // The next unit into ``u``; false when none is left.
  bool take(Unit &u) {
    const int64_t unit = next.fetch_add(1);
    if (unit >= first[tensors]) return false;
    while (first[u.tensor + 1] <= unit) u.tensor++;
    u.index = unit;
    u.start = (unit - first[u.tensor]) * UNIT;
    u.end = u.start + UNIT < numel[u.tensor] ? u.start + UNIT : numel[u.tensor];
    return true;
  }
};
