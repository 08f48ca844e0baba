// The dstate I/O owner (DESIGN.md section 6).
//
// Every DRAM <-> register transition along the dstate (N) axis goes through this
// header: the kernels' recurrence bodies work on float32 register arrays only and
// issue no raw load or store of pool, B, C or A elements themselves.
//
// A row along N is read in chunks of VEC elements. The layout decision is a
// template parameter (kUnit), made once by the caller outside the chunk loop:
//   kUnit = true   unit stride: one vector-wide load/store per chunk
//                  (16-byte transactions on CUDA; auto-vectorised loops on CPU)
//   kUnit = false  any other stride: a scalar gather/scatter per element
// A stride-0 operand is not a row: it is read once with load_splat() and used as
// a scalar. The tail chunk (N % VEC elements) always goes through the scalar
// partial path, in both layouts, so the arithmetic -- and therefore the result --
// never depends on the layout.
//
// Host/device clean: compiled by g++ for the CPU kernels and by nvcc for CUDA.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <stdint.h>

#include <type_traits>

// Always inlined: on the CPU the callers are compiled once per instruction set
// (target_clones), and only code inlined into them gets that instruction set.
#if defined(__CUDACC__)
#define SSD_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define SSD_HD inline __attribute__((always_inline))
#else
#define SSD_HD inline
#endif

namespace ssd {

// The three element types the pool and the inputs may have.
enum class Dtype : int8_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

template <typename T> struct DtypeOf;
template <> struct DtypeOf<float> { static constexpr Dtype value = Dtype::kFloat32; };
template <> struct DtypeOf<c10::BFloat16> { static constexpr Dtype value = Dtype::kBFloat16; };
template <> struct DtypeOf<c10::Half> { static constexpr Dtype value = Dtype::kFloat16; };

// Widen is exact; narrow rounds to nearest even (c10's conversions do both, on
// host and device alike).
SSD_HD float widen(float v) { return v; }

template <typename T> SSD_HD T narrow(float v) { return T(v); }
template <> SSD_HD float narrow<float>(float v) { return v; }

#if defined(__CUDACC__) || !defined(__GNUC__)  // nvcc (both passes) keeps c10's conversions
SSD_HD float widen(c10::BFloat16 v) { return static_cast<float>(v); }
SSD_HD float widen(c10::Half v) { return static_cast<float>(v); }
#else
// Host half types: the same values as c10's conversions (round to nearest even),
// written so the compiler vectorises the chunk loops: c10's bfloat16 rounding
// branches on NaN per element, and its float16 conversion is a long bit-twiddle.
SSD_HD float widen(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}
// Raw storage bits of the rounded value; plain integer arithmetic on arrays of
// these vectorises where constructing c10 structs element by element does not.
SSD_HD uint16_t narrow_bits(float v, c10::BFloat16) {
  uint32_t bits;
  __builtin_memcpy(&bits, &v, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;  // nearest, ties to even
  return static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);  // NaN stays NaN
}
template <> SSD_HD c10::BFloat16 narrow<c10::BFloat16>(float v) {
  return c10::BFloat16(narrow_bits(v, c10::BFloat16{}), c10::BFloat16::from_bits());
}
#if defined(__FLT16_MAX__)  // the compiler has _Float16 (F16C instructions where enabled)
SSD_HD float widen(c10::Half v) {
  _Float16 h;
  __builtin_memcpy(&h, &v.x, sizeof h);
  return static_cast<float>(h);
}
SSD_HD uint16_t narrow_bits(float v, c10::Half) {
  const _Float16 h = static_cast<_Float16>(v);
  uint16_t bits;
  __builtin_memcpy(&bits, &h, sizeof bits);
  return bits;
}
#else
SSD_HD float widen(c10::Half v) { return static_cast<float>(v); }
SSD_HD uint16_t narrow_bits(float v, c10::Half) { return c10::Half(v).x; }
#endif
template <> SSD_HD c10::Half narrow<c10::Half>(float v) {
  return c10::Half(narrow_bits(v, c10::Half{}), c10::Half::from_bits());
}
#define SSD_HOST_NARROW_BITS 1
#endif

// One element whose type is known only at run time (per-channel scalars: x, z,
// dt, D, dt_bias, a broadcast A, and y).
SSD_HD float load_scalar(const void* base, int64_t offset, Dtype dtype) {
  switch (dtype) {
    case Dtype::kBFloat16: return widen(static_cast<const c10::BFloat16*>(base)[offset]);
    case Dtype::kFloat16: return widen(static_cast<const c10::Half*>(base)[offset]);
    default: return static_cast<const float*>(base)[offset];
  }
}

SSD_HD void store_scalar(void* base, int64_t offset, Dtype dtype, float v) {
  switch (dtype) {
    case Dtype::kBFloat16: static_cast<c10::BFloat16*>(base)[offset] = narrow<c10::BFloat16>(v); break;
    case Dtype::kFloat16: static_cast<c10::Half*>(base)[offset] = narrow<c10::Half>(v); break;
    default: static_cast<float*>(base)[offset] = v; break;
  }
}

// ---------------------------------------------------------------------------
// Chunk verbs: VEC elements of one row into / out of a float register array.
// ---------------------------------------------------------------------------

// Unit stride. On CUDA the caller guarantees 16-byte alignment of p whenever
// VEC * sizeof(T) is a multiple of 16 (checked once on the host).
template <int VEC, typename T>
SSD_HD void load_unit(const T* p, float (&r)[VEC]) {
#if defined(__CUDA_ARCH__)
  if constexpr ((VEC * sizeof(T)) % 16 == 0) {
    constexpr int kPer16 = 16 / sizeof(T);
#pragma unroll
    for (int i = 0; i < VEC / kPer16; ++i) {
      const uint4 raw = reinterpret_cast<const uint4*>(p)[i];
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < kPer16; ++j) r[i * kPer16 + j] = widen(e[j]);
    }
    return;
  }
#endif
#if defined(SSD_HOST_NARROW_BITS) && defined(__FLT16_MAX__)
  if constexpr (std::is_same_v<T, c10::Half> && VEC % 8 == 0) {  // F16C's vcvtph2ps where enabled
    typedef float f32x8 __attribute__((vector_size(32)));
    typedef _Float16 f16x8 __attribute__((vector_size(16)));
    for (int i = 0; i < VEC; i += 8) {
      f16x8 h;
      __builtin_memcpy(&h, p + i, sizeof h);
      const f32x8 f = __builtin_convertvector(h, f32x8);
      __builtin_memcpy(r + i, &f, sizeof f);
    }
    return;
  }
#endif
#pragma unroll
  for (int v = 0; v < VEC; ++v) r[v] = widen(p[v]);
}

template <int VEC, typename T>
SSD_HD void store_unit(T* p, const float (&r)[VEC]) {
#if defined(__CUDA_ARCH__)
  if constexpr ((VEC * sizeof(T)) % 16 == 0) {
    constexpr int kPer16 = 16 / sizeof(T);
#pragma unroll
    for (int i = 0; i < VEC / kPer16; ++i) {
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int j = 0; j < kPer16; ++j) e[j] = narrow<T>(r[i * kPer16 + j]);
      reinterpret_cast<uint4*>(p)[i] = raw;
    }
    return;
  }
#endif
#if defined(SSD_HOST_NARROW_BITS)
  if constexpr (std::is_same_v<T, c10::BFloat16> && VEC % 16 == 0) {
    // Explicit vectors: the compiler's vectoriser gives up on this rounding inside
    // the large step loop and would leave it one element at a time. Round in place
    // so each result sits in the high half of its 32-bit lane, then gather the high
    // halves of 16 lanes with one shuffle.
    typedef uint32_t u32x8 __attribute__((vector_size(32)));
    typedef uint16_t u16x16 __attribute__((vector_size(32)));
    // Whole-vector loads and bit casts only: a vector assembled from narrower
    // stack stores cannot be store-forwarded and stalls.
    for (int i = 0; i < VEC; i += 16) {
      u32x8 lo, hi;
      __builtin_memcpy(&lo, r + i, sizeof lo);
      __builtin_memcpy(&hi, r + i + 8, sizeof hi);
      const u32x8 lo_nan = (lo & 0x7FFFFFFFu) > 0x7F800000u, hi_nan = (hi & 0x7FFFFFFFu) > 0x7F800000u;
      lo = (lo_nan & 0x7FC00000u) | (~lo_nan & (lo + 0x7FFFu + ((lo >> 16) & 1u)));  // nearest, ties to even
      hi = (hi_nan & 0x7FC00000u) | (~hi_nan & (hi + 0x7FFFu + ((hi >> 16) & 1u)));
      const u16x16 halves[2] = {(u16x16)lo, (u16x16)hi};
#if defined(__clang__)
      const u16x16 out = __builtin_shufflevector(halves[0], halves[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19,
                                                 21, 23, 25, 27, 29, 31);
#else
      const u16x16 out = __builtin_shuffle(halves[0], halves[1],
                                           u16x16{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
#endif
      __builtin_memcpy(static_cast<void*>(p + i), &out, sizeof out);
    }
    return;
  }
#if defined(__FLT16_MAX__)
  if constexpr (std::is_same_v<T, c10::Half> && VEC % 8 == 0) {  // F16C's vcvtps2ph where enabled
    typedef float f32x8 __attribute__((vector_size(32)));
    typedef _Float16 f16x8 __attribute__((vector_size(16)));
    for (int i = 0; i < VEC; i += 8) {
      f32x8 f;
      __builtin_memcpy(&f, r + i, sizeof f);
      const f16x8 h = __builtin_convertvector(f, f16x8);
      __builtin_memcpy(static_cast<void*>(p + i), &h, sizeof h);
    }
    return;
  }
#endif
#endif
#pragma unroll
  for (int v = 0; v < VEC; ++v) p[v] = narrow<T>(r[v]);
}

// Any stride: one scalar access per element.
template <int VEC, typename T>
SSD_HD void load_gather(const T* p, int64_t stride, float (&r)[VEC]) {
#pragma unroll
  for (int v = 0; v < VEC; ++v) r[v] = widen(p[v * stride]);
}

template <int VEC, typename T>
SSD_HD void store_scatter(T* p, int64_t stride, const float (&r)[VEC]) {
#pragma unroll
  for (int v = 0; v < VEC; ++v) p[v * stride] = narrow<T>(r[v]);
}

// The tail chunk: `count` < VEC elements, the rest of r set to zero.
template <int VEC, typename T>
SSD_HD void load_partial(const T* p, int64_t stride, int count, float (&r)[VEC]) {
#pragma unroll
  for (int v = 0; v < VEC; ++v) r[v] = v < count ? widen(p[v * stride]) : 0.0f;
}

template <int VEC, typename T>
SSD_HD void store_partial(T* p, int64_t stride, int count, const float (&r)[VEC]) {
#pragma unroll
  for (int v = 0; v < VEC; ++v)
    if (v < count) p[v * stride] = narrow<T>(r[v]);
}

// A stride-0 operand: one load, used as a scalar.
template <typename T>
SSD_HD float load_splat(const T* p) { return widen(*p); }

// One row along N with its layout fixed at compile time. chunk c covers
// elements [c * VEC, c * VEC + VEC).
template <int VEC, bool kUnit, typename T>
struct DstateRow {
  T* base;
  int64_t stride;  // in elements; ignored when kUnit

  SSD_HD void load(int64_t c, float (&r)[VEC]) const {
    if constexpr (kUnit) load_unit<VEC>(base + c * VEC, r);
    else load_gather<VEC>(base + c * VEC * stride, stride, r);
  }
  SSD_HD void store(int64_t c, const float (&r)[VEC]) const {
    if constexpr (kUnit) store_unit<VEC>(base + c * VEC, r);
    else store_scatter<VEC>(base + c * VEC * stride, stride, r);
  }
  SSD_HD void load_tail(int64_t c, int count, float (&r)[VEC]) const {
    load_partial<VEC>(base + c * VEC * (kUnit ? 1 : stride), kUnit ? 1 : stride, count, r);
  }
  SSD_HD void store_tail(int64_t c, int count, const float (&r)[VEC]) const {
    store_partial<VEC>(base + c * VEC * (kUnit ? 1 : stride), kUnit ? 1 : stride, count, r);
  }
};

// ---------------------------------------------------------------------------
// Row verbs (one thread, one whole row): what the load_state / load_bc /
// store_state ops do per (row, head, p) or (row, group).
// ---------------------------------------------------------------------------

// Widen n elements of src (stride `stride`) into contiguous float dst.
template <int VEC, bool kUnit, typename T>
SSD_HD void load_row(const T* src, int64_t stride, int64_t n, float* dst) {
  const DstateRow<VEC, kUnit, const T> row{src, stride};
  const int64_t full = n / VEC;
  float r[VEC];
  for (int64_t c = 0; c < full; ++c) {
    row.load(c, r);
#pragma unroll
    for (int v = 0; v < VEC; ++v) dst[c * VEC + v] = r[v];
  }
  if (const int rest = static_cast<int>(n - full * VEC)) {
    row.load_tail(full, rest, r);
    for (int v = 0; v < rest; ++v) dst[full * VEC + v] = r[v];
  }
}

// Round n float32 elements of src (stride src_stride) into dst (stride
// dst_stride), once. kUnit: both strides are 1.
template <int VEC, bool kUnit, typename T>
SSD_HD void store_row(const float* src, int64_t src_stride, T* dst, int64_t dst_stride, int64_t n) {
  const DstateRow<VEC, kUnit, const float> in{src, src_stride};
  const DstateRow<VEC, kUnit, T> out{dst, dst_stride};
  const int64_t full = n / VEC;
  float r[VEC];
  for (int64_t c = 0; c < full; ++c) {
    in.load(c, r);
    out.store(c, r);
  }
  if (const int rest = static_cast<int>(n - full * VEC)) {
    in.load_tail(full, rest, r);
    out.store_tail(full, rest, r);
  }
}

// ---------------------------------------------------------------------------
// CUDA only: asynchronous staging of unit-stride chunks into shared memory
// (cp.async on sm_80+). A staged chunk occupies no register while it is in
// flight, so a block can keep far more bytes in flight than its registers hold.
// The caller guarantees 16-byte alignment of both addresses.
// ---------------------------------------------------------------------------
#if defined(__CUDACC__)
template <int VEC, typename T>
__device__ __forceinline__ void stage_unit_async(const T* p, void* smem) {
  static_assert(VEC * sizeof(T) == 16, "one chunk is one 16-byte copy");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(p) : "memory");
#else
  *static_cast<uint4*>(smem) = *reinterpret_cast<const uint4*>(p);
#endif
}

// Close the group of copies issued so far (call after issuing a batch).
__device__ __forceinline__ void stage_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Wait until every chunk this thread staged has landed (visible to this thread).
__device__ __forceinline__ void stage_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

// Wait until every group but the `kPending` most recent ones has landed (a
// pipeline: the current stage is ready while later ones are still in flight).
template <int kPending>
__device__ __forceinline__ void stage_wait_prior() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Widen a staged chunk.
template <int VEC, typename T>
__device__ __forceinline__ void load_staged(const void* smem, float (&r)[VEC]) {
  load_unit<VEC>(static_cast<const T*>(smem), r);
}
#endif  // __CUDACC__

}  // namespace ssd
