// Vectors of W floats for the CPU kernels: GCC/Clang vector types, one source for AVX2 and AVX-512,
// and the loads that widen each cache dtype to float32.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace slotserve {

// GCC/Clang vector extensions: one source for AVX2 (8 lanes) and AVX-512 (16 lanes).
#if defined(__AVX512F__)
constexpr int64_t W = 16;
#else
constexpr int64_t W = 8;
#endif
typedef float vfloat __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(W * sizeof(uint32_t))));
typedef uint16_t vhalf __attribute__((vector_size(W * sizeof(uint16_t))));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vfloat load(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
#if defined(__AVX512F__)
  // One 512-bit widening. GCC lowers __builtin_convertvector of 16 lanes to two 256-bit widenings and
  // a lane insert (with or without -mprefer-vector-width=512): 6 instructions for every key and value
  // vector loaded instead of 2.
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<vfloat>(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
#else
  vhalf bits;
  std::memcpy(&bits, p, sizeof(bits));
  vuint wide = __builtin_convertvector(bits, vuint) << 16;
  vfloat v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
#endif
}

inline vfloat load(const int8_t* p) {  // a quantized cache's values, unscaled
#if defined(__AVX512F__)
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vfloat>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bits)));
#else
  typedef int8_t vbyte __attribute__((vector_size(W)));
  vbyte bits;
  std::memcpy(&bits, p, sizeof(bits));
  return __builtin_convertvector(bits, vfloat);
#endif
}

inline vfloat load(const c10::Half* p) {
  float tmp[W];
  for (int64_t i = 0; i < W; ++i) tmp[i] = static_cast<float>(p[i]);
  return load(tmp);
}

inline float hsum(vfloat v) {
  float total = 0.f;
  for (int64_t i = 0; i < W; ++i) total += v[i];
  return total;
}

// exp(x) for x <= 0 (softmax after subtracting the row maximum): 2^n * p(r), r = x - n ln 2.
inline vfloat exp_nonpositive(vfloat x) {
  const vfloat lo = vfloat{} - 87.f;
  x = x < lo ? lo : x;
  vint n = __builtin_convertvector(x * 1.44269504f - 0.5f, vint);  // round to nearest (x <= 0)
  vfloat nf = __builtin_convertvector(n, vfloat);
  vfloat r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vfloat p = vfloat{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  vint bits = (n + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// max |x[i]| over n floats, n a multiple of W.
inline float abs_max(const float* x, int64_t n) {
  vfloat peaks{};
  for (int64_t i = 0; i < n; i += W) {
    vfloat v = load(x + i);
    v = v < 0 ? -v : v;
    peaks = v > peaks ? v : peaks;
  }
  float peak = 0.f;
  for (int64_t i = 0; i < W; ++i) peak = peaks[i] > peak ? peaks[i] : peak;
  return peak;
}

// out[i] = x[i] * inv rounded to the nearest integer (ties to even) within +-127, for n floats (a
// multiple of W); returns the sum of out. With AVX-512 it is vector instructions: std::nearbyint is a
// libm call per value under -ffast-math, which made quantizing a query cost as much as scoring it.
inline int32_t round_to_int8(const float* x, int64_t n, float inv, int8_t* out) {
#if defined(__AVX512F__)
  __m512i sum = _mm512_setzero_si512();
  const __m512 scale = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), scale), lo), hi);
    const __m512i r = _mm512_cvtps_epi32(y);  // MXCSR's rounding: to nearest, ties to even
    sum = _mm512_add_epi32(sum, r);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtsepi32_epi8(r));
  }
  return _mm512_reduce_add_epi32(sum);
#else
  int32_t sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float r = std::nearbyint(x[i] * inv);
    out[i] = static_cast<int8_t>(r < -127.f ? -127.f : (r > 127.f ? 127.f : r));
    sum += out[i];
  }
  return sum;
#endif
}

// Calls f(std::integral_constant<int, G>{}) for G = g, with the code compiled for every G from 1
// to 8 (register-resident accumulators need G at compile time); g is at most 8.
template <typename F>
inline void with_group(int64_t g, F&& f) {
  switch (g) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

}  // namespace slotserve
