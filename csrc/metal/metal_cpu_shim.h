// metal_cpu_shim.h: compile the unmodified Metal kernels (csrc/metal/*.metal) as
// C++17 with g++ and run every thread of a launch on the CPU.
//
// No Apple GPU is available in CI, so this is how the exact Metal source is
// executed there (tests/test_metal_cpu.py). The .metal files start with
// `#include <metal_stdlib>`; the test points that include at a file that includes
// this header. What it provides, all of it used by the kernels:
//   - address-space qualifiers (device, constant, thread) and the Metal attributes
//     ([[kernel]], [[host_name]], [[buffer(i)]], [[thread_position_in_grid]])
//     as macros that vanish (constant becomes const);
//   - scalar types uint/ushort/uchar, half and (Metal >= 3.1) bfloat, both with
//     exact widening and round-to-nearest-even narrowing, as on the GPU;
//   - vector types (float4, half4, ushort4, uint3, ...) with Metal's constructors
//     (splat, element list, explicit element-type conversion), component-wise
//     arithmetic, shifts and indexing, and the packed_* types (element alignment);
//   - the metal functions the kernels call: fma, as_type, precise::exp, precise::log;
//   - metal_cpu::dispatch, which runs a kernel for every thread position of a grid.
//
// __METAL_VERSION__ defaults to 310 (Metal 3.1); compile with -D__METAL_VERSION__=300
// to run the pre-3.1 code paths. Below 3.1 there is no bfloat here either, so a
// kernel that uses it unguarded fails to compile, as it would on the device.
#pragma once

// Every standard header first: the macros below would break them.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#ifndef __METAL_VERSION__
#define __METAL_VERSION__ 310
#endif

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;

namespace metal {

// ---------------------------------------------------------------------------
// 16-bit floating point: storage plus the conversions the GPU performs.
// ---------------------------------------------------------------------------

namespace detail {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// IEEE binary16, round to nearest even (subnormals, overflow to inf, NaN kept).
inline uint16_t f32_to_f16(float f) {
  const uint32_t x = bits_of(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t mag = x & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((mag >> 13) & 0x3FFu));
  if (mag >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (mag >= 0x38800000u) {                                              // a normal half
    const uint32_t rounded = mag + 0xFFFu + ((mag >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((rounded - (112u << 23)) >> 13));
  }
  if (mag <= 0x33000000u) return static_cast<uint16_t>(sign);  // <= 2^-25 rounds to 0
  // A subnormal half: the value in units of 2^-24, rounded to nearest even.
  const uint32_t mant = (mag & 0x7FFFFFu) | 0x800000u;
  const int shift = 126 - static_cast<int>(mag >> 23);  // 14 .. 24
  const uint32_t half_ulp = 1u << (shift - 1);
  const uint32_t rest = mant & ((1u << shift) - 1u);
  uint32_t q = mant >> shift;
  if (rest > half_ulp || (rest == half_ulp && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0x1Fu) return float_of(sign | 0x7F800000u | (mant << 13));
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(mant), -24);  // exact
    return sign ? -v : v;
  }
  return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
}

// bfloat16, round to nearest even; a NaN stays a (quiet) NaN.
inline uint16_t f32_to_bf16(float f) {
  const uint32_t x = bits_of(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

inline float bf16_to_f32(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

}  // namespace detail

struct half {
  uint16_t bits;
  half() = default;
  half(float f) : bits(detail::f32_to_f16(f)) {}
  operator float() const { return detail::f16_to_f32(bits); }
};

#if __METAL_VERSION__ >= 310
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  bfloat(float f) : bits(detail::f32_to_bf16(f)) {}
  operator float() const { return detail::bf16_to_f32(bits); }
};
#endif

// ---------------------------------------------------------------------------
// Vector types.
// ---------------------------------------------------------------------------

template <typename T, int N> struct vec;
template <typename T, int N> struct packed_vec;

// Element storage and access shared by every width.
template <typename T, int N> struct vec_elems;
template <typename T> struct vec_elems<T, 2> { T x, y; };
template <typename T> struct vec_elems<T, 3> { T x, y, z; };
template <typename T> struct vec_elems<T, 4> { T x, y, z, w; };

// Metal's aligned vectors: 2 -> 2x, 3 and 4 -> 4x the element alignment.
template <typename T, int N>
struct alignas(sizeof(T) * (N == 2 ? 2 : 4)) vec : vec_elems<T, N> {
  using elem_type = T;

  vec() = default;
  // float4(v): every element v (Metal's scalar constructor).
  explicit vec(T v) {
    for (int i = 0; i < N; ++i) (*this)[i] = v;
  }
  template <typename... Ts, typename = std::enable_if_t<sizeof...(Ts) == N && (N > 1)>>
  vec(Ts... vs) {
    const T list[N] = {static_cast<T>(vs)...};
    for (int i = 0; i < N; ++i) (*this)[i] = list[i];
  }
  // float4(half4): element-type conversion is explicit in Metal.
  template <typename U, typename = std::enable_if_t<!std::is_same<U, T>::value>>
  explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; ++i) (*this)[i] = static_cast<T>(o[i]);
  }
  // A packed vector of the same element type converts either way.
  vec(const packed_vec<T, N>& p) {
    for (int i = 0; i < N; ++i) (*this)[i] = p.e[i];
  }

  T& operator[](int i) { return reinterpret_cast<T*>(this)[i]; }
  const T& operator[](int i) const { return reinterpret_cast<const T*>(this)[i]; }
};

// packed_float4 etc.: element alignment, so any element-aligned address works.
template <typename T, int N>
struct packed_vec {
  T e[N];
  packed_vec() = default;
  packed_vec(const vec<T, N>& v) {
    for (int i = 0; i < N; ++i) e[i] = v[i];
  }
  T& operator[](int i) { return e[i]; }
  const T& operator[](int i) const { return e[i]; }
};

#define METAL_CPU_VEC_BINARY(OP)                                                       \
  template <typename T, int N>                                                         \
  vec<T, N> operator OP(const vec<T, N>& a, const vec<T, N>& b) {                      \
    vec<T, N> r;                                                                       \
    for (int i = 0; i < N; ++i) r[i] = static_cast<T>(a[i] OP b[i]);                   \
    return r;                                                                          \
  }                                                                                    \
  template <typename T, int N, typename S, typename = std::enable_if_t<std::is_arithmetic<S>::value>> \
  vec<T, N> operator OP(const vec<T, N>& a, S b) {                                     \
    return a OP vec<T, N>(static_cast<T>(b));                                          \
  }                                                                                    \
  template <typename T, int N, typename S, typename = std::enable_if_t<std::is_arithmetic<S>::value>> \
  vec<T, N> operator OP(S a, const vec<T, N>& b) {                                     \
    return vec<T, N>(static_cast<T>(a)) OP b;                                          \
  }                                                                                    \
  template <typename T, int N, typename S>                                             \
  vec<T, N>& operator OP##=(vec<T, N>& a, const S& b) {                                \
    return a = a OP b;                                                                 \
  }

METAL_CPU_VEC_BINARY(+)
METAL_CPU_VEC_BINARY(-)
METAL_CPU_VEC_BINARY(*)
METAL_CPU_VEC_BINARY(/)
METAL_CPU_VEC_BINARY(<<)
METAL_CPU_VEC_BINARY(>>)
METAL_CPU_VEC_BINARY(&)
METAL_CPU_VEC_BINARY(|)
#undef METAL_CPU_VEC_BINARY

template <typename T, int N>
vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = -a[i];
  return r;
}

#define METAL_CPU_VEC_TYPES(T, NAME)    \
  typedef vec<T, 2> NAME##2;            \
  typedef vec<T, 3> NAME##3;            \
  typedef vec<T, 4> NAME##4;            \
  typedef packed_vec<T, 2> packed_##NAME##2; \
  typedef packed_vec<T, 3> packed_##NAME##3; \
  typedef packed_vec<T, 4> packed_##NAME##4;

METAL_CPU_VEC_TYPES(float, float)
METAL_CPU_VEC_TYPES(half, half)
METAL_CPU_VEC_TYPES(int, int)
METAL_CPU_VEC_TYPES(uint, uint)
METAL_CPU_VEC_TYPES(short, short)
METAL_CPU_VEC_TYPES(ushort, ushort)
#if __METAL_VERSION__ >= 310
METAL_CPU_VEC_TYPES(bfloat, bfloat)
#endif
#undef METAL_CPU_VEC_TYPES

// ---------------------------------------------------------------------------
// Functions.
// ---------------------------------------------------------------------------

// Reinterpret the bits of a value of the same size (Metal's as_type<T>).
template <typename To, typename From>
To as_type(const From& v) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs types of one size");
  To r;
  std::memcpy(&r, &v, sizeof r);
  return r;
}

// fma is a single rounding on the GPU and here.
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
template <int N>
vec<float, N> fma(const vec<float, N>& a, const vec<float, N>& b, const vec<float, N>& c) {
  vec<float, N> r;
  for (int i = 0; i < N; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
}

namespace precise {
inline float exp(float v) { return std::exp(v); }
inline float log(float v) { return std::log(v); }
}  // namespace precise

}  // namespace metal

// ---------------------------------------------------------------------------
// Running a kernel on the CPU.
// ---------------------------------------------------------------------------

namespace metal_cpu {

using metal::uint2;
using metal::uint3;

// One bound argument (what compile_shader's kernel call binds at index i: a
// tensor's memory at its storage offset, or bytes) as the kernel parameter type.
template <typename P> struct Bind;
template <typename T> struct Bind<T*> {
  static T* get(void* p) { return static_cast<T*>(p); }
};
template <typename T> struct Bind<T&> {
  static T& get(void* p) { return *static_cast<T*>(p); }
};

// The [[thread_position_in_grid]] parameter, which is the kernel's last one.
template <typename P> struct Position;
template <> struct Position<uint> {
  static uint make(uint x, uint, uint) { return x; }
};
template <> struct Position<uint2> {
  static uint2 make(uint x, uint y, uint) { return uint2(x, y); }
};
template <> struct Position<uint3> {
  static uint3 make(uint x, uint y, uint z) { return uint3(x, y, z); }
};

struct Grid {
  uint x = 1, y = 1, z = 1;
  bool reverse = false;  // run the threads last to first (finds order dependence)
};

template <typename... Ps, size_t... I>
void run_grid(void (*fn)(Ps...), void* const* args, const Grid& g, std::index_sequence<I...>) {
  using Params = std::tuple<Ps...>;
  using Pos = std::tuple_element_t<sizeof...(Ps) - 1, Params>;
  const uint64_t count = static_cast<uint64_t>(g.x) * g.y * g.z;
  for (uint64_t k = 0; k < count; ++k) {
    const uint64_t i = g.reverse ? count - 1 - k : k;
    const uint x = static_cast<uint>(i % g.x);
    const uint y = static_cast<uint>((i / g.x) % g.y);
    const uint z = static_cast<uint>(i / (static_cast<uint64_t>(g.x) * g.y));
    fn(Bind<std::tuple_element_t<I, Params>>::get(args[I])..., Position<Pos>::make(x, y, z));
  }
}

// Number of bound arguments (buffers) a kernel takes.
template <typename... Ps>
constexpr int arity(void (*)(Ps...)) {
  return static_cast<int>(sizeof...(Ps)) - 1;
}

// Run fn once for every thread position of the grid; args[i] is buffer i.
template <typename... Ps>
void dispatch(void (*fn)(Ps...), void* const* args, const Grid& g) {
  static_assert(sizeof...(Ps) >= 1, "a kernel takes its thread position last");
  run_grid(fn, args, g, std::make_index_sequence<sizeof...(Ps) - 1>{});
}

}  // namespace metal_cpu

// Metal keywords and attributes. Defined last: standard headers must not see them.
#define kernel
#define device
#define constant const
#define thread
#define host_name(name)
#define buffer(index)
#define thread_position_in_grid
