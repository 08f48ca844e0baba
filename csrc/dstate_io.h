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
// written so that they vectorise: c10's bfloat16 rounding branches on NaN per
// element, and its float16 conversion is reached through calls per element.
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
// Half: c10's portable IEEE conversions (fp16_ieee_to_fp32_value and
// fp16_ieee_from_fp32_value: integer steps and a few exact float operations),
// written once for a scalar (U = uint32_t, F = float) or a vector of lanes. The
// chunk loops then vectorise them in every instruction set -- GCC 12 turns
// vectors of _Float16 into one conversion per element even where F16C exists --
// and every path (vector, gather, tail) gives the same bits.
#if !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // U, F may be vectors; always inlined, never passed in a call
#endif
template <typename U, typename F>
SSD_HD F half_to_float_high(U w) {  // the half in the high 16 bits of w, low bits 0
  const U sign = w & 0x80000000u, two_w = w + w;
  U norm_bits = (two_w >> 4) + (0xE0u << 23), denorm_bits = (two_w >> 17) | (126u << 23);
  F norm, denorm;
  __builtin_memcpy(&norm, &norm_bits, sizeof norm);
  __builtin_memcpy(&denorm, &denorm_bits, sizeof denorm);
  norm = norm * 0x1.0p-112f;     // exponent rebias; Inf and NaN stay Inf and NaN
  denorm = denorm - 0.5f;        // a subnormal half, exactly
  __builtin_memcpy(&norm_bits, &norm, sizeof norm);
  __builtin_memcpy(&denorm_bits, &denorm, sizeof denorm);
  const U bits = sign | (two_w < (1u << 27) ? denorm_bits : norm_bits);
  F f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename U, typename F>
SSD_HD U float_to_half(F f) {  // the half's bits in the low 16 bits
  U w;
  __builtin_memcpy(&w, &f, sizeof w);
  const U shl1_w = w + w, sign = w & 0x80000000u;
  const U abs_bits = w & 0x7FFFFFFFu;
  F base;
  __builtin_memcpy(&base, &abs_bits, sizeof base);
  base = (base * 0x1.0p+112f) * 0x1.0p-110f;  // overflows to Inf where the half does
  U bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? U{} + 0x71000000u : bias;
  const U rounder_bits = (bias >> 1) + 0x07800000u;
  F rounder;
  __builtin_memcpy(&rounder, &rounder_bits, sizeof rounder);
  base = rounder + base;  // rounds to the half's precision, nearest even
  U bits;
  __builtin_memcpy(&bits, &base, sizeof bits);
  const U nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
  return (sign >> 16) | (shl1_w > 0xFF000000u ? U{} + 0x7E00u : nonsign);  // NaN: 0x7E00
}
#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif

SSD_HD float widen(c10::Half v) { return half_to_float_high<uint32_t, float>(static_cast<uint32_t>(v.x) << 16); }
SSD_HD uint16_t narrow_bits(float v, c10::Half) { return static_cast<uint16_t>(float_to_half<uint32_t, float>(v)); }
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

#if defined(__CUDACC__)
// Widen the 2 * W elements of T packed in W 32-bit words (the first element of a
// word in its low half). For bfloat16 a word's two floats are its low half shifted
// up and its high half masked: one instruction each (element by element the
// compiler extracts the high half first). The same values as widen().
template <int W, typename T>
__device__ __forceinline__ void widen_words(const uint32_t* w, float* r) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
#pragma unroll
    for (int i = 0; i < W; ++i) {
      r[2 * i] = __uint_as_float(w[i] << 16);
      r[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
  } else {
    const T* e = reinterpret_cast<const T*>(w);
#pragma unroll
    for (int v = 0; v < W * 4 / static_cast<int>(sizeof(T)); ++v) r[v] = widen(e[v]);
  }
}
#endif

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
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
      widen_words<4, T>(words, r + i * kPer16);
    }
    return;
  }
#endif
#pragma unroll
  for (int v = 0; v < VEC; ++v) r[v] = widen(p[v]);
}

#if defined(__CUDA_ARCH__)
// Two adjacent elements rounded by one conversion (cvt.rn.bf16x2 / f16x2: the same
// round-to-nearest-even, and the same NaN, as two single conversions), packed
// into one 32-bit word, the first element in the low half.
template <typename T>
__device__ __forceinline__ uint32_t narrow_pair(float first, float second) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(first, second);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    static_assert(std::is_same_v<T, c10::Half>, "16-bit element types only");
    const __half2 v = __floats2half2_rn(first, second);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}
#endif

template <int VEC, typename T>
SSD_HD void store_unit(T* p, const float (&r)[VEC]) {
#if defined(__CUDA_ARCH__)
  if constexpr ((VEC * sizeof(T)) % 16 == 0 && sizeof(T) == 2) {
#pragma unroll
    for (int i = 0; i < VEC / 8; ++i) {
      uint4 raw;
      raw.x = narrow_pair<T>(r[8 * i], r[8 * i + 1]);
      raw.y = narrow_pair<T>(r[8 * i + 2], r[8 * i + 3]);
      raw.z = narrow_pair<T>(r[8 * i + 4], r[8 * i + 5]);
      raw.w = narrow_pair<T>(r[8 * i + 6], r[8 * i + 7]);
      reinterpret_cast<uint4*>(p)[i] = raw;
    }
    return;
  } else if constexpr ((VEC * sizeof(T)) % 16 == 0) {
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
// Host only (GCC / clang): chunks of 16 elements held in two 8-lane float
// vectors, for the CPU step's inner loop. Which register lane holds which
// element is the pool type's choice (ChunkOrder), picked so that widening and
// rounding need no cross-lane shuffle:
//   float        natural order: elements 0-7 in lo, 8-15 in hi;
//   16-bit       paired order: even elements in lo, odd ones in hi (one 32-bit
//                word holds elements 2j and 2j+1: a shift or a mask takes each
//                to its own lane, and a shift and an or pack them back).
// The arithmetic is per element, so the order changes no bit. Every row that
// meets a chunk in the arithmetic (B, C, a per-element A) is widened into
// scratch in the same order (load_row_ordered); a row's tail (N % 16 elements)
// stays in natural order and goes through the scalar verbs above.
// ---------------------------------------------------------------------------
#if defined(SSD_HOST_NARROW_BITS)
// These take and return 32-byte vectors; they are always inlined, so no call
// ever passes one and GCC's note about the AVX calling convention does not apply.
#if !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
typedef float HostF32x8 __attribute__((vector_size(32)));
typedef uint32_t HostU32x8 __attribute__((vector_size(32)));

struct HostChunk {
  HostF32x8 lo, hi;
};

template <typename T> struct ChunkOrder { static constexpr bool kPaired = false; };
template <> struct ChunkOrder<c10::BFloat16> { static constexpr bool kPaired = true; };
template <> struct ChunkOrder<c10::Half> { static constexpr bool kPaired = true; };

// The register lane (0-7: lo, 8-15: hi) of element v of a chunk.
template <typename Order>
constexpr int chunk_lane(int v) { return ChunkOrder<Order>::kPaired ? (v & 1) * 8 + v / 2 : v; }

// v - 0 is v for every v (v + 0 is not: -0.0 + 0.0 = +0.0); the compiler makes it one broadcast.
SSD_HD HostF32x8 host_splat(float v) { return v - HostF32x8{}; }

// Lane-wise narrow_bits(v, BFloat16{}), the result in the high half of each word.
SSD_HD HostU32x8 round_bf16_high(HostF32x8 v) {
  const HostU32x8 bits = (HostU32x8)v;
  const HostU32x8 rounded = bits + 0x7FFFu + ((bits >> 16) & 1u);  // nearest, ties to even
  return v != v ? HostU32x8{} + 0x7FC00000u : rounded;            // NaN stays NaN
}

// One chunk (elements [0, 16) from p) into registers, in T's order.
template <bool kUnit, typename T>
SSD_HD void load_chunk(const T* p, int64_t stride, HostChunk& r) {
  if constexpr (kUnit && std::is_same_v<T, float>) {
    __builtin_memcpy(&r.lo, p, sizeof r.lo);
    __builtin_memcpy(&r.hi, p + 8, sizeof r.hi);
  } else if constexpr (kUnit && std::is_same_v<T, c10::BFloat16>) {
    HostU32x8 w;
    __builtin_memcpy(&w, p, sizeof w);
    r.lo = (HostF32x8)(w << 16);
    r.hi = (HostF32x8)(w & 0xFFFF0000u);
  } else if constexpr (kUnit && std::is_same_v<T, c10::Half>) {
    HostU32x8 w;
    __builtin_memcpy(&w, p, sizeof w);
    r.lo = half_to_float_high<HostU32x8, HostF32x8>(w << 16);
    r.hi = half_to_float_high<HostU32x8, HostF32x8>(w & 0xFFFF0000u);
  } else {
    float f[16];
    if constexpr (kUnit) load_unit<16>(p, f);
    else load_gather<16>(p, stride, f);
    float o[16];
    for (int v = 0; v < 16; ++v) o[chunk_lane<T>(v)] = f[v];
    __builtin_memcpy(&r.lo, o, sizeof r.lo);
    __builtin_memcpy(&r.hi, o + 8, sizeof r.hi);
  }
}

// One chunk from registers (T's order) to p, rounded once.
template <bool kUnit, typename T>
SSD_HD void store_chunk(T* p, int64_t stride, const HostChunk& r) {
  if constexpr (kUnit && std::is_same_v<T, float>) {
    __builtin_memcpy(static_cast<void*>(p), &r.lo, sizeof r.lo);
    __builtin_memcpy(static_cast<void*>(p + 8), &r.hi, sizeof r.hi);
  } else if constexpr (kUnit && std::is_same_v<T, c10::BFloat16>) {
    const HostU32x8 w = (round_bf16_high(r.lo) >> 16) | (round_bf16_high(r.hi) & 0xFFFF0000u);
    __builtin_memcpy(static_cast<void*>(p), &w, sizeof w);
  } else if constexpr (kUnit && std::is_same_v<T, c10::Half>) {
    const HostU32x8 w = float_to_half<HostU32x8, HostF32x8>(r.lo) | (float_to_half<HostU32x8, HostF32x8>(r.hi) << 16);
    __builtin_memcpy(static_cast<void*>(p), &w, sizeof w);
  } else {
    float o[16];
    __builtin_memcpy(o, &r.lo, sizeof r.lo);
    __builtin_memcpy(o + 8, &r.hi, sizeof r.hi);
    float f[16];
    for (int v = 0; v < 16; ++v) f[v] = o[chunk_lane<T>(v)];
    if constexpr (kUnit) store_unit<16>(p, f);
    else store_scatter<16>(p, stride, f);
  }
}

// load_row, with each whole chunk in the lane order of pool type Order.
template <typename Order, bool kUnit, typename T>
SSD_HD void load_row_ordered(const T* src, int64_t stride, int64_t n, float* dst) {
  load_row<16, kUnit>(src, stride, n, dst);
  if constexpr (ChunkOrder<Order>::kPaired) {
    for (int64_t c = 0; c < n / 16; ++c) {
      float f[16];
      for (int v = 0; v < 16; ++v) f[v] = dst[c * 16 + v];
      for (int v = 0; v < 16; ++v) dst[c * 16 + chunk_lane<Order>(v)] = f[v];
    }
  }
}

// A chunk of float scratch already in chunk order (see load_row_ordered).
SSD_HD HostChunk load_ordered_chunk(const float* p) {
  HostChunk r;
  __builtin_memcpy(&r.lo, p, sizeof r.lo);
  __builtin_memcpy(&r.hi, p + 8, sizeof r.hi);
  return r;
}
#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // SSD_HOST_NARROW_BITS

// ---------------------------------------------------------------------------
// CUDA only: asynchronous staging of unit-stride chunks into shared memory
// (cp.async on sm_80+). A staged chunk occupies no register while it is in
// flight, so a block can keep far more bytes in flight than its registers hold.
// The caller guarantees 16-byte alignment of both addresses.
// ---------------------------------------------------------------------------
#if defined(__CUDACC__)
// BYTES (8 or 16) bytes, both addresses aligned to BYTES.
template <int BYTES>
__device__ __forceinline__ void stage_bytes_async(const void* p, void* smem) {
  static_assert(BYTES == 8 || BYTES == 16, "8- or 16-byte copies");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (BYTES == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(p) : "memory");
  else asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(p) : "memory");
#else
  using Word = std::conditional_t<BYTES == 16, uint4, uint2>;
  *static_cast<Word*>(smem) = *static_cast<const Word*>(p);
#endif
}

template <int VEC, typename T>
__device__ __forceinline__ void stage_unit_async(const T* p, void* smem) {
  static_assert(VEC * sizeof(T) == 16, "one chunk is one 16-byte copy");
  stage_bytes_async<16>(p, smem);
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

// A unit-stride chunk of VEC elements of a read-only operand that many threads
// share (B and C), held as its raw bits between its load and its widening: a load
// may then be issued well before its use (a multi-token row loads token k + 1's
// chunks before it stores token k's state) in half the registers for 16-bit types.
template <int VEC, typename T>
struct RawChunk {
  static constexpr int kBytes = VEC * static_cast<int>(sizeof(T));
  static_assert(kBytes % 8 == 0, "a chunk of whole 8-byte words");
  alignas(16) uint2 w[kBytes / 8];
};

// Vector loads of a chunk that many threads read: from global memory through the
// non-coherent cache (so the block's other rows hit L1), or from shared memory
// (kStaged: a chunk staged there by stage_bytes_async). p is aligned to
// min(16, VEC * sizeof(T)) bytes (checked on the host).
template <int VEC, typename T, bool kStaged = false>
__device__ __forceinline__ RawChunk<VEC, T> load_raw_shared(const T* p) {
  RawChunk<VEC, T> c;
  if constexpr (RawChunk<VEC, T>::kBytes % 16 == 0) {
#pragma unroll
    for (int i = 0; i < RawChunk<VEC, T>::kBytes / 16; ++i) {
      const uint4* q = reinterpret_cast<const uint4*>(p) + i;
      const uint4 v = kStaged ? *q : __ldg(q);
      c.w[2 * i] = make_uint2(v.x, v.y);
      c.w[2 * i + 1] = make_uint2(v.z, v.w);
    }
  } else {
    const uint2* q = reinterpret_cast<const uint2*>(p);
    c.w[0] = kStaged ? *q : __ldg(q);
  }
  return c;
}

template <int VEC, typename T>
__device__ __forceinline__ void widen_raw(const RawChunk<VEC, T>& c, float (&r)[VEC]) {
  constexpr int kWords = RawChunk<VEC, T>::kBytes / 4;
  uint32_t words[kWords];
#pragma unroll
  for (int i = 0; i < kWords / 2; ++i) words[2 * i] = c.w[i].x, words[2 * i + 1] = c.w[i].y;
  widen_words<kWords, T>(words, r);
}

// load_raw_shared, widened at once.
template <int VEC, typename T>
__device__ __forceinline__ void load_unit_shared(const T* p, float (&r)[VEC]) {
  widen_raw(load_raw_shared<VEC>(p), r);
}

// One 16-byte chunk of a unit-stride row held as its raw bits (4 registers for 8
// bfloat16 elements, where widened floats take 8): the state of the lean kernel
// between its load and its use, and between its rounding and its store.
template <typename T>
__device__ __forceinline__ uint4 load_chunk_raw(const T* p) {
  return *reinterpret_cast<const uint4*>(p);
}

template <typename T>
__device__ __forceinline__ void store_chunk_raw(T* p, uint4 raw) {
  *reinterpret_cast<uint4*>(p) = raw;
}

// The same with the evict-first ("streaming") hint: a state that no later access of the
// kernel reads (the multi-token step's K writes, the single-token step's rows) need not
// push its inputs out of L2.
template <typename T>
__device__ __forceinline__ void store_chunk_streaming(T* p, uint4 raw) {
  __stcs(reinterpret_cast<uint4*>(p), raw);
}

// The same as one 16-byte store instruction, always: in the lean kernel's streamed
// rows the compiler split some chunks into their four words and stored those with
// four 32-bit stores. The memory clobber keeps it in program order with every other
// access, as a plain store is kept where it may alias them. (Not the default: in
// kernels that hold all their rows it cost registers, and spills at 64.)
// kEvictFirst: with the evict-first hint, as store_chunk_streaming.
template <bool kEvictFirst = false, typename T>
__device__ __forceinline__ void store_chunk_v4(T* p, uint4 raw) {
  if constexpr (kEvictFirst)
    asm volatile("st.global.cs.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(raw.x), "r"(raw.y), "r"(raw.z),
                 "r"(raw.w)
                 : "memory");
  else
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(raw.x), "r"(raw.y), "r"(raw.z),
                 "r"(raw.w)
                 : "memory");
}

template <int VEC, typename T>
__device__ __forceinline__ void widen_chunk(uint4 raw, float (&r)[VEC]) {
  static_assert(VEC * sizeof(T) == 16, "one chunk is 16 bytes");
  load_unit<VEC>(reinterpret_cast<const T*>(&raw), r);
}

template <int VEC, typename T>
__device__ __forceinline__ uint4 narrow_chunk(const float (&r)[VEC]) {
  static_assert(VEC * sizeof(T) == 16, "one chunk is 16 bytes");
  uint4 raw;
  store_unit<VEC>(reinterpret_cast<T*>(&raw), r);
  return raw;
}

// Widen a staged chunk.
template <int VEC, typename T>
__device__ __forceinline__ void load_staged(const void* smem, float (&r)[VEC]) {
  load_unit<VEC>(static_cast<const T*>(smem), r);
}
#endif  // __CUDACC__

}  // namespace ssd
