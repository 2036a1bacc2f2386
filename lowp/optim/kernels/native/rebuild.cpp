// lowp: the whole-tensor sums of sharded tensors rebuilt from every holder's pieces in one call
// (lowp.optim.ordered_sum.Rebuild.totals, the definition: the same additions in the same order, so
// the same bits). The indices are the Rebuild's, made and checked in Python once per layout; each
// is checked against its array here again before it is used.
#include <math.h>
#include <stdint.h>

#include <limits>
#include <new>
#include <stdexcept>
#include <vector>

namespace {

// The index arrays of a Rebuild, in the order of ``index`` (lowp.optim.kernels.native.rebuild).
enum Index {
  UNIT_TO, UNIT_FROM, PARTIAL, SIZES, BLOCK_TO, BLOCK_FROM, TERM_TO, TERM_FROM, SPLIT, BASE, NUNITS, INDICES
};
// The sizes of ``count``: the values, units, blocks (of the partial units), then the length of
// each index array (UNIT_TO / UNIT_FROM share one, PARTIAL / SIZES, BLOCK_TO / BLOCK_FROM, TERM_TO /
// TERM_FROM, then SPLIT, and BASE / NUNITS: the tensors).
enum Count { VALUES, UNITS, BLOCKS, UNIT_PIECES, PARTIALS, BLOCK_PIECES, TERMS, SPLITS, TENSORS, COUNTS };

constexpr int64_t BLOCK = 16;
constexpr int64_t PER_UNIT = (1 << 15) / BLOCK;

inline bool inside(int64_t i, int64_t n) { return i >= 0 && i < n; }

}  // namespace

static int64_t rebuild(const double *values, const int64_t *count, const int64_t *const *index, double *totals) {
  for (int c = 0; c < COUNTS; c++)
    if (count[c] < 0) return -1;
  const int64_t nvalues = count[VALUES], nunits = count[UNITS], nblocks = count[BLOCKS];
  if (count[SPLITS] > nblocks) return -1;  // each split block is a block: splits * BLOCK cannot overflow
  std::vector<double> units(nunits, 0.0), blocks(nblocks, 0.0);
  const int64_t *to = index[UNIT_TO], *from = index[UNIT_FROM];
  for (int64_t k = 0; k < count[UNIT_PIECES]; k++) {
    if (!inside(to[k], nunits) || !inside(from[k], nvalues)) return -1;
    units[to[k]] = values[from[k]];
  }
  to = index[BLOCK_TO], from = index[BLOCK_FROM];
  for (int64_t k = 0; k < count[BLOCK_PIECES]; k++) {
    if (!inside(to[k], nblocks) || !inside(from[k], nvalues)) return -1;
    blocks[to[k]] = values[from[k]];
  }
  // blocks split between holders: steps 1 and 2 from their terms (zeros where no element is)
  const int64_t splits = count[SPLITS];
  std::vector<float> terms(splits * BLOCK, 0.0f);
  to = index[TERM_TO], from = index[TERM_FROM];
  for (int64_t k = 0; k < count[TERMS]; k++) {
    if (!inside(to[k], splits * BLOCK) || !inside(from[k], nvalues)) return -1;
    const double v = values[from[k]];
    terms[to[k]] = (float)v;
    if ((double)(float)v != v && !isnan(v)) return k + 1;
  }
  const int64_t *split = index[SPLIT];
  for (int64_t j = 0; j < splits; j++) {
    if (!inside(split[j], nblocks)) return -1;
    const float *t = &terms[j * BLOCK];
    double b = (double)(t[0] + t[1]);
    for (int lane = 1; lane < BLOCK / 2; lane++) b += (double)(t[2 * lane] + t[2 * lane + 1]);
    blocks[split[j]] = b;
  }
  // step 3 for the partial units: each one's blocks from its first, then a zero where the Python
  // definition pads the row to a power of two (-0.0 + 0.0 is +0.0)
  const int64_t *partial = index[PARTIAL], *sizes = index[SIZES];
  int64_t first = 0;
  for (int64_t i = 0; i < count[PARTIALS]; i++) {
    const int64_t n = sizes[i];
    if (!inside(partial[i], nunits) || n < 1 || n > PER_UNIT || n > nblocks - first) return -1;
    double s = blocks[first];
    for (int64_t k = 1; k < n; k++) s += blocks[first + k];
    if (n & (n - 1)) s += 0.0;
    units[partial[i]] = s;
    first += n;
  }
  // step 4: each tensor's units in order from +0.0
  const int64_t *base = index[BASE], *per_tensor = index[NUNITS];
  for (int64_t t = 0; t < count[TENSORS]; t++) {
    if (per_tensor[t] < 0 || !inside(base[t], nunits + 1) || per_tensor[t] > nunits - base[t]) return -1;
    double s = 0.0;
    for (int64_t u = 0; u < per_tensor[t]; u++) s += units[base[t] + u];
    totals[t] = isnan(s) ? std::numeric_limits<double>::quiet_NaN() : s;  // the one NaN (ordered_sum)
  }
  return 0;
}

// totals[t] for every tensor t. Returns 0; k + 1 when term k is no fp32 value (its float64 value
// changes when rounded to fp32, and is no NaN); -1 when a size or an index is outside its range;
// -3 when the units and blocks cannot be allocated (no exception leaves the library).
extern "C" int64_t lowp_rebuild(const double *values, const int64_t *count, const int64_t *const *index,
                                double *totals) {
  try {
    return rebuild(values, count, index, totals);
  } catch (const std::bad_alloc &) {
    return -3;
  } catch (const std::length_error &) {  // more than a vector can hold
    return -3;
  } catch (...) {
    return -1;
  }
}
