// A gated MLP's activation of one row, act(gate) * up, for GeGLU (tanh GELU) and SwiGLU (SiLU) (gated_act.cpp,
// moe_decode.cpp). In fp32: gelu_tanh(g) = g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)) (= 0.5 g (1 + tanh(.))),
// silu(g) = g * sigmoid(g), sigmoid(v) = 1 / (1 + exp(-v)) with numerics.h's vectorised exp (~1 ulp); times up in
// fp32, rounded to the output dtype once (bf16: round to nearest even).
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

// out[i] = act(gate[i]) * up[i] for n entries of bf16 (uint16_t bits) or fp32
template <bool Gelu, typename T>
void gated_row(const T* gate, const T* up, T* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float g = load(gate[i]);
    store(out + i, (Gelu ? gelu_tanh(g) : silu(g)) * load(up[i]));
  }
}

}  // namespace hybridkv_cpu
