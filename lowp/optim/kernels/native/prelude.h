// lowp native kernels: the system headers of the generated step variants, precompiled once per
// compiler and flags (lowp/optim/kernels/native/build.py) and passed to every variant's build with
// -include. Parsing <immintrin.h> is about half of a variant's build; a precompiled header reads
// it back instead. The kernel headers include what they use themselves, so they build without it.
#pragma once
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <utility>
#include <vector>
