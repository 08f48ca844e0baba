// What the CPU kernel files share: the per-ISA compilation of the hot loops, the
// chunk width (which fixes the order in which y is reduced), and the run-time
// dtype / layout dispatch into templates.
#pragma once

#include <type_traits>

#include "../dstate_io.h"
#include "../step.h"

namespace ssd {
namespace cpu {

// The hot loops are compiled twice on x86-64 Linux: for AVX2/F16C and for the
// baseline ISA, picked at load time (an ifunc). Baseline SSE2 cannot pack 32-bit
// lanes to 16 bits, so half-precision pools would stay scalar without it. Mul and
// add round the same in every ISA (and -ffp-contract=off keeps FMA out), so the
// clones give bit-identical results.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define SSD_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define SSD_CPU_CLONES
#endif
// Only code inlined into an SSD_CPU_CLONES function gets its instruction set, so
// the templates and the dispatch lambdas under it are forced inline.
#define SSD_CPU_INLINE inline __attribute__((always_inline))
#define SSD_CPU_INLINE_LAMBDA __attribute__((always_inline))

// Floats per chunk: four SSE or two AVX registers. Every CPU kernel reduces y over
// these 16 lanes with one fixed tree, so their results agree bit for bit.
constexpr int kVec = 16;

template <typename Fn>
SSD_CPU_INLINE void with_dtype(Dtype dtype, Fn&& fn) {
  switch (dtype) {
    case Dtype::kBFloat16: fn(c10::BFloat16{}); break;
    case Dtype::kFloat16: fn(c10::Half{}); break;
    default: fn(float{}); break;
  }
}

template <typename Fn>
SSD_CPU_INLINE void with_flag(bool flag, Fn&& fn) {
  if (flag) fn(std::true_type{});
  else fn(std::false_type{});
}

// Widen one row whose dtype is known only at run time (B, C, a per-element A)
// into contiguous float32 scratch, through the dstate I/O owner.
SSD_CPU_INLINE void widen_row(const OperandRef& r, int64_t offset, int64_t stride, int64_t n, float* out) {
  with_dtype(r.dtype, [&](auto tag) SSD_CPU_INLINE_LAMBDA {
    using T = decltype(tag);
    const T* p = static_cast<const T*>(r.data) + offset;
    with_flag(stride == 1, [&](auto unit) SSD_CPU_INLINE_LAMBDA {
      load_row<kVec, decltype(unit)::value>(p, stride, n, out);
    });
  });
}

// The fixed reduction tree of the 16 lanes of y's partial sums.
SSD_CPU_INLINE float reduce_lanes(float* acc) {
  for (int w = kVec / 2; w > 0; w /= 2)
    for (int v = 0; v < w; ++v) acc[v] += acc[v + w];
  return acc[0];
}

}  // namespace cpu
}  // namespace ssd
