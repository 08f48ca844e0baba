// The dstate I/O owner for the Metal kernels (DESIGN.md section 6); the Metal
// counterpart of csrc/dstate_io.h.
//
// Every device-memory <-> register transition of pool, B, C and a per-element A
// goes through this file: the kernel bodies (ssd_kernels.metal) work on float32
// registers only. A row along N is read in chunks of VEC = 4 elements into one
// float4. The layout is a template parameter (kUnit), fixed once per launch by the
// host, outside every loop:
//   kUnit = true   unit stride: one packed 4-wide load/store per chunk (packed
//                  types need only element alignment, so views at any storage
//                  offset are fine; 16-bit chunks are 8-byte accesses)
//   kUnit = false  any other stride (stride 0 included): one scalar access per
//                  element
// The tail chunk (N % 4 elements) goes through the scalar partial path in both
// layouts. Both layouts produce the same float4 values, and the arithmetic on
// them is shared, so the layout never changes a result bit.
//
// Loads widen exactly to float32; stores round once, to nearest even.
//
// torch_ssd/mps.py concatenates this file and ssd_kernels.metal, in that order,
// and compiles them with torch.mps.compile_shader; tests/test_metal_cpu.py compiles
// the same text with g++ under csrc/metal/metal_cpu_shim.h.

#include <metal_stdlib>
using namespace metal;

// bfloat arrived in Metal 3.1 (macOS 14). Before that a bfloat16 element is its
// raw 16 bits: widened by a shift, narrowed with explicit round-to-nearest-even.
#if __METAL_VERSION__ >= 310
typedef bfloat bf16_t;
#else
typedef ushort bf16_t;
#endif

// Run-time dtype codes of the per-channel operands (torch_ssd/mps.py DTYPE_CODE).
enum SsdDtype : int { kSsdF32 = 0, kSsdBF16 = 1, kSsdF16 = 2 };

// bfloat16 <-> float32 on raw bits. Used for every run-time-typed bfloat16 scalar,
// and for all bfloat16 traffic below Metal 3.1.
inline float bf16_bits_to_float(ushort bits) { return as_type<float>(uint(bits) << 16); }

inline ushort float_to_bf16_bits(float v) {
  const uint u = as_type<uint>(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return ushort((u >> 16) | 0x40u);  // NaN stays NaN
  return ushort((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// ---------------------------------------------------------------------------
// Elem<T>: one element or one 4-chunk of storage type T, widened to float32, and
// the rounding stores back.
// ---------------------------------------------------------------------------

template <typename T> struct Elem;

template <> struct Elem<float> {
  static float load(device const float* p) { return *p; }
  static float4 load4(device const float* p) {
    return float4(*reinterpret_cast<device const packed_float4*>(p));
  }
  static void store(device float* p, float v) { *p = v; }
  static void store4(device float* p, float4 v) {
    *reinterpret_cast<device packed_float4*>(p) = packed_float4(v);
  }
};

template <> struct Elem<half> {
  static float load(device const half* p) { return float(*p); }
  static float4 load4(device const half* p) {
    return float4(half4(*reinterpret_cast<device const packed_half4*>(p)));
  }
  static void store(device half* p, float v) { *p = half(v); }
  static void store4(device half* p, float4 v) {
    *reinterpret_cast<device packed_half4*>(p) = packed_half4(half4(v));
  }
};

#if __METAL_VERSION__ >= 310
template <> struct Elem<bfloat> {
  static float load(device const bfloat* p) { return float(*p); }
  static float4 load4(device const bfloat* p) {
    return float4(bfloat4(*reinterpret_cast<device const packed_bfloat4*>(p)));
  }
  static void store(device bfloat* p, float v) { *p = bfloat(v); }
  static void store4(device bfloat* p, float4 v) {
    *reinterpret_cast<device packed_bfloat4*>(p) = packed_bfloat4(bfloat4(v));
  }
};
#else
template <> struct Elem<ushort> {  // bfloat16 as raw bits
  static float load(device const ushort* p) { return bf16_bits_to_float(*p); }
  static float4 load4(device const ushort* p) {
    const ushort4 bits = ushort4(*reinterpret_cast<device const packed_ushort4*>(p));
    return as_type<float4>(uint4(bits) << 16);
  }
  static void store(device ushort* p, float v) { *p = float_to_bf16_bits(v); }
  static void store4(device ushort* p, float4 v) {
    const ushort4 bits = ushort4(float_to_bf16_bits(v.x), float_to_bf16_bits(v.y),
                                 float_to_bf16_bits(v.z), float_to_bf16_bits(v.w));
    *reinterpret_cast<device packed_ushort4*>(p) = packed_ushort4(bits);
  }
};
#endif

// ---------------------------------------------------------------------------
// Run-time-typed scalars: the per-channel operands (x, dt, z, D, dt_bias, a
// broadcast A) and y, whose dtypes vary independently of the pool's.
// ---------------------------------------------------------------------------

inline float load_scalar(device const uchar* base, long i, int dtype) {
  if (dtype == kSsdBF16) return bf16_bits_to_float(reinterpret_cast<device const ushort*>(base)[i]);
  if (dtype == kSsdF16) return float(reinterpret_cast<device const half*>(base)[i]);
  return reinterpret_cast<device const float*>(base)[i];
}

inline void store_scalar(device uchar* base, long i, int dtype, float v) {
  if (dtype == kSsdBF16) {
    reinterpret_cast<device ushort*>(base)[i] = float_to_bf16_bits(v);
  } else if (dtype == kSsdF16) {
    reinterpret_cast<device half*>(base)[i] = half(v);
  } else {
    reinterpret_cast<device float*>(base)[i] = v;
  }
}

// ---------------------------------------------------------------------------
// One row along N, read or written in 4-chunks. Chunk c covers elements
// [4c, 4c + 4); tail(c, count) covers the last count < 4 elements.
// ---------------------------------------------------------------------------

template <typename T, bool kUnit>
struct DstateReader {
  device const T* base;
  long stride;  // elements between consecutive n; unused when kUnit

  float4 chunk(long c) const {
    if (kUnit) return Elem<T>::load4(base + c * 4);
    device const T* p = base + c * 4 * stride;
    return float4(Elem<T>::load(p), Elem<T>::load(p + stride), Elem<T>::load(p + 2 * stride),
                  Elem<T>::load(p + 3 * stride));
  }

  // Lanes at and past count read as 0.
  float4 tail(long c, int count) const {
    const long step = kUnit ? 1 : stride;
    device const T* p = base + c * 4 * step;
    float4 r = float4(0.0f);
    for (int v = 0; v < count; ++v) r[v] = Elem<T>::load(p + v * step);
    return r;
  }
};

template <typename T, bool kUnit>
struct DstateWriter {
  device T* base;
  long stride;  // unused when kUnit

  void chunk(long c, float4 r) const {
    if (kUnit) {
      Elem<T>::store4(base + c * 4, r);
      return;
    }
    device T* p = base + c * 4 * stride;
    Elem<T>::store(p, r.x);
    Elem<T>::store(p + stride, r.y);
    Elem<T>::store(p + 2 * stride, r.z);
    Elem<T>::store(p + 3 * stride, r.w);
  }

  void tail(long c, int count, float4 r) const {
    const long step = kUnit ? 1 : stride;
    device T* p = base + c * 4 * step;
    for (int v = 0; v < count; ++v) Elem<T>::store(p + v * step, r[v]);
  }
};
