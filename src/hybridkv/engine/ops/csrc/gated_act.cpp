// A gated MLP's activation in one pass: act(gate) * up, for GeGLU (tanh GELU) and SwiGLU (SiLU)
// (hybridkv.engine.ops.gated_act).
//
// gate and up (rows, I), each row's entries contiguous (a row stride of their own: the halves of one joined
// gate-up projection). In fp32: gelu_tanh(g) = g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)) (= 0.5 g (1 + tanh(.))),
// silu(g) = g * sigmoid(g), sigmoid(v) = 1 / (1 + exp(-v)) with a vectorised exp (Cephes' polynomial, ~1 ulp);
// times up in fp32, rounded to the output dtype once (bf16: round to nearest even).
//
// Built without trapping math (the pragma below) so the exp's rounding and float -> int conversion vectorise: no
// value changes, only that floating-point exceptions are not assumed to trap.
#pragma GCC optimize("no-trapping-math")
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

namespace {

inline float bf16_to_float(uint16_t bits) {
  uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &widened, sizeof(out));
  return out;
}

inline uint16_t float_to_bf16(float value) {  // round to nearest even; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

inline float exp_approx(float x) {  // Cephes expf: exp(x) = 2^n exp(r), |r| <= ln2 / 2; clamped to fp32's range
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

inline float gelu_tanh(float g) {
  const float z = 1.5957691216057308f * std::fma(0.044715f * g, g * g, g);  // 2 sqrt(2 / pi) (g + 0.044715 g^3)
  return g / (1.0f + exp_approx(-z));
}

inline float silu(float g) { return g / (1.0f + exp_approx(-g)); }

template <bool Gelu>
void row_bf16(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float g = bf16_to_float(gate[i]);
    out[i] = float_to_bf16((Gelu ? gelu_tanh(g) : silu(g)) * bf16_to_float(up[i]));
  }
}

template <bool Gelu>
void row_f32(const float* gate, const float* up, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = (Gelu ? gelu_tanh(gate[i]) : silu(gate[i])) * up[i];
}

at::Tensor gated_act(const at::Tensor& gate, const at::Tensor& up, c10::string_view act) {
  const bool gelu = act == "gelu_tanh";
  TORCH_CHECK(gelu || act == "silu", "gated_act: act is gelu_tanh or silu, got ", std::string(act));
  TORCH_CHECK(gate.device().is_cpu() && up.device().is_cpu() && gate.dim() == 2 && up.sizes() == gate.sizes() &&
                  gate.stride(1) == 1 && up.stride(1) == 1,
              "gated_act: CPU gate and up of one shape (rows, I), each row contiguous; got ", gate.sizes(), " and ",
              up.sizes());
  TORCH_CHECK(gate.scalar_type() == up.scalar_type() &&
                  (gate.scalar_type() == at::kBFloat16 || gate.scalar_type() == at::kFloat),
              "gated_act: gate and up both bf16 or both fp32, got ", gate.scalar_type(), " and ", up.scalar_type());
  const int64_t rows = gate.size(0), n = gate.size(1);
  auto out = at::empty({rows, n}, gate.options());
  const int64_t gs = gate.stride(0), us = up.stride(0);
  const bool bf16 = gate.scalar_type() == at::kBFloat16;
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (bf16) {
        const auto* g = static_cast<const uint16_t*>(gate.data_ptr()) + r * gs;
        const auto* u = static_cast<const uint16_t*>(up.data_ptr()) + r * us;
        auto* o = static_cast<uint16_t*>(out.data_ptr()) + r * n;
        gelu ? row_bf16<true>(g, u, o, n) : row_bf16<false>(g, u, o, n);
      } else {
        const float* g = gate.data_ptr<float>() + r * gs;
        const float* u = up.data_ptr<float>() + r * us;
        float* o = out.data_ptr<float>() + r * n;
        gelu ? row_f32<true>(g, u, o, n) : row_f32<false>(g, u, o, n);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridkv, m) {
  m.def("gated_act(Tensor gate, Tensor up, str act) -> Tensor", &gated_act);
}
