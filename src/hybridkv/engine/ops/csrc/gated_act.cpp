// A gated MLP's activation in one pass: act(gate) * up, for GeGLU (tanh GELU) and SwiGLU (SiLU)
// (hybridkv.engine.ops.gated_act).
//
// gate and up (rows, I), each row's entries contiguous (a row stride of their own: the halves of one joined
// gate-up projection); each row by gated.h's gated_row (in fp32, rounded to the output dtype once).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "gated.h"
#include "numerics.h"

namespace {  // internal linkage: inlined freely (a shared library's exported functions are not)
namespace hybridkv_gated_act {

using namespace hybridkv_cpu;

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
        gelu ? gated_row<true>(g, u, o, n) : gated_row<false>(g, u, o, n);
      } else {
        const float* g = gate.data_ptr<float>() + r * gs;
        const float* u = up.data_ptr<float>() + r * us;
        float* o = out.data_ptr<float>() + r * n;
        gelu ? gated_row<true>(g, u, o, n) : gated_row<false>(g, u, o, n);
      }
    }
  });
  return out;
}

}  // namespace hybridkv_gated_act
}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridkv, m) {
  m.def("gated_act(Tensor gate, Tensor up, str act) -> Tensor", &hybridkv_gated_act::gated_act);
}
