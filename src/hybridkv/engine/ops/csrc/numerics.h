// Scalar helpers the kernels share (inline, written so that `#pragma omp simd` loops over them vectorise):
// bf16 <-> fp32 (round to nearest even, NaN kept), load / store of bf16 or fp32 entries as fp32, a bf16 dot product
// in fp32 (VDPBF16PS where the CPU has it), and a vectorisable exp (Cephes' expf polynomial: exp(x) = 2^n exp(r),
// |r| <= ln2 / 2, ~1 ulp; clamped to fp32's range; its loops vectorise with -fno-trapping-math, one of ops.native's
// flags).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace hybridkv_cpu {

// always inlined: a call left in a `#pragma omp simd` loop keeps it scalar (GCC declines to inline exp_approx once
// several kernels call it)
#define HYBRIDKV_INLINE inline __attribute__((always_inline))

HYBRIDKV_INLINE float bf16_to_float(uint16_t bits) {
  uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &widened, sizeof(out));
  return out;
}

HYBRIDKV_INLINE uint16_t float_to_bf16(float value) {  // round to nearest even; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

HYBRIDKV_INLINE float load(uint16_t v) { return bf16_to_float(v); }
HYBRIDKV_INLINE float load(float v) { return v; }
HYBRIDKV_INLINE void store(uint16_t* out, float v) { *out = float_to_bf16(v); }
HYBRIDKV_INLINE void store(float* out, float v) { *out = v; }

HYBRIDKV_INLINE float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = std::fma(n, -0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float y = std::fma(p, r * r, r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return y * two_n;
}

#if defined(__AVX512F__)
// exp_approx on 16 lanes: the same clamp, reduction and polynomial, lane for lane the same results
HYBRIDKV_INLINE __m512 exp_approx16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i two_n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(two_n));
}

// 16 entries as fp32, and back: bf16 widened, rounded to nearest even, as bf16_to_float / float_to_bf16 do one at
// a time (VCVTNEPS2BF16 where the CPU has it, ~1.4x faster on a SiLU gate: a NaN stays a NaN with its sign and
// payload, where float_to_bf16 writes 0x7FC0, and a result below fp32's smallest normal, ~1.2e-38, becomes zero)
HYBRIDKV_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
HYBRIDKV_INLINE __m512 load16(const uint16_t* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
HYBRIDKV_INLINE void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// 16 fp32 lanes rounded to bf16 (the 16-bit halves of a __m256i)
HYBRIDKV_INLINE __m256i bf16x16(__m512 v) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
#endif
}
HYBRIDKV_INLINE void store16(uint16_t* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16x16(v)); }
#endif

// q . k over d bf16 entries (as uint16 bits), in fp32: VDPBF16PS over 32-entry blocks where the CPU has it
HYBRIDKV_INLINE float dot_bf16(const uint16_t* q, const uint16_t* k, int64_t d) {
  float dot = 0.0f;
  int64_t i = 0;
#if defined(__AVX512BF16__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 32 <= d; i += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + i), (__m512bh)_mm512_loadu_si512(k + i));
  dot = _mm512_reduce_add_ps(acc);
#endif
  float rest = 0.0f;
#if defined(__AVX512BF16__)
  // a plain loop: a `omp simd` reduction ends in a serial sum of its 16 lanes even when it runs no iteration (d a
  // multiple of 32), ~64 cycles a dot
  for (int64_t j = i; j < d; ++j) rest += bf16_to_float(q[j]) * bf16_to_float(k[j]);
#else
#pragma omp simd reduction(+ : rest)
  for (int64_t j = i; j < d; ++j) rest += bf16_to_float(q[j]) * bf16_to_float(k[j]);
#endif
  return dot + rest;
}

}  // namespace hybridkv_cpu
