// A gated MLP's activation of one row, act(gate) * up, for GeGLU (tanh GELU) and SwiGLU (SiLU) (gated_act.cpp,
// moe_decode.cpp; silu alone: rms_norm.cpp's gated norm). In fp32: gelu_tanh(g) = g * sigmoid(2 sqrt(2/pi) (g +
// 0.044715 g^3)) (= 0.5 g (1 + tanh(.))), silu(g) = g * sigmoid(g), sigmoid(v) = 1 / (1 + exp(-v)) with numerics.h's
// vectorised exp (~1 ulp); times up in fp32, rounded to the output dtype once (bf16: round to nearest even).
#pragma once

#include <cmath>
#include <cstdint>

#include "numerics.h"

namespace hybridkv_cpu {

HYBRIDKV_INLINE float gelu_tanh(float g) {
  const float z = 1.5957691216057308f * std::fma(0.044715f * g, g * g, g);  // 2 sqrt(2 / pi) (g + 0.044715 g^3)
  return g / (1.0f + exp_approx(-z));
}

HYBRIDKV_INLINE float silu(float g) { return g / (1.0f + exp_approx(-g)); }

// out[i] = act(gate[i]) * up[i] for n entries of bf16 (uint16_t bits) or fp32; 16 lanes at a time where the CPU has
// AVX-512 (numerics.h's exp_approx16, load16 / store16: the scalar loop's results lane for lane, bar store16's NaN
// bits and denormals; GCC's vectorisation of that loop ran 1.2-1.4x slower on bf16)
template <bool Gelu, typename T>
void gated_row(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 g = load16(gate + i);
    const __m512 v = Gelu ? _mm512_mul_ps(_mm512_set1_ps(1.5957691216057308f),
                                          _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g),
                                                          _mm512_mul_ps(g, g), g))
                          : g;
    const __m512 e = exp_approx16(_mm512_sub_ps(_mm512_setzero_ps(), v));
    const __m512 act = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    store16(out + i, _mm512_mul_ps(act, load16(up + i)));
  }
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) {  // the tail (every entry without AVX-512)
    const float g = load(gate[j]);
    store(out + j, (Gelu ? gelu_tanh(g) : silu(g)) * load(up[j]));
  }
}

}  // namespace hybridkv_cpu
