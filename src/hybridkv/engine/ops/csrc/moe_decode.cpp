// Routed experts of a decode's few tokens in one call (hybridkv.engine.ops.moe_decode): for each token and each of
// its k chosen experts, gate_up = x W_gu^T (rounded to the dtype, as a projection's output), inner = act(gate) * up
// (gated.h: rounded once), y = inner W_down^T (rounded to the dtype), summed over the token's experts times their
// routing weights in fp32 and rounded once.
//
// x (T, H) contiguous; index (T, k) int64, each entry one of the E experts (all checked before any is used); weights
// (T, k) of x's dtype; gate_up (E, 2I, H) with the gate's I rows first, down (E, H, I), each row of both contiguous;
// all bf16 or all fp32. Each product streams the chosen expert's weight once (gemv.h's gemv_rows), its output rows
// split among the threads.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "gated.h"
#include "gemv.h"
#include "numerics.h"

namespace {  // internal linkage: inlined freely (a shared library's exported functions are not)
namespace hybridkv_moe_decode {

using namespace hybridkv_cpu;

template <class L>
void run(const at::Tensor& x, const int64_t* index, const at::Tensor& weights, const at::Tensor& gate_up,
         const at::Tensor& down, bool gelu, at::Tensor& out) {
  using T = typename L::T;
  const int64_t tokens = x.size(0), hidden = x.size(1), k = weights.size(1), inner_size = down.size(2);
  const T* xp = static_cast<const T*>(x.data_ptr());
  const T* wp = static_cast<const T*>(weights.data_ptr());
  const T* gu = static_cast<const T*>(gate_up.data_ptr());
  const T* dp = static_cast<const T*>(down.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  std::vector<T> both(2 * inner_size), inner(inner_size), y(hidden);
  std::vector<float> sum(hidden);
  for (int64_t t = 0; t < tokens; ++t) {
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = index[t * k + j];
      gemv_rows<L>(xp + t * hidden, 1, gu + e * gate_up.stride(0), gate_up.stride(1), nullptr, both.data(), hidden,
                   2 * inner_size);
      gelu ? gated_row<true>(both.data(), both.data() + inner_size, inner.data(), inner_size)
           : gated_row<false>(both.data(), both.data() + inner_size, inner.data(), inner_size);
      gemv_rows<L>(inner.data(), 1, dp + e * down.stride(0), down.stride(1), nullptr, y.data(), inner_size, hidden);
      const float weight = load(wp[t * k + j]);
#pragma omp simd
      for (int64_t h = 0; h < hidden; ++h) sum[h] += weight * load(y[h]);
    }
    for (int64_t h = 0; h < hidden; ++h) store(op + t * hidden + h, sum[h]);
  }
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& index, const at::Tensor& weights,
                       const at::Tensor& gate_up, const at::Tensor& down, c10::string_view act) {
  const bool gelu = act == "gelu_tanh";
  TORCH_CHECK(gelu || act == "silu", "moe_experts: act is gelu_tanh or silu, got ", std::string(act));
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "moe_experts: x a contiguous CPU (T, H) "
              "tensor, got ", x.sizes(), " strides ", x.strides());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "moe_experts: x bf16 or fp32, got ", dtype);
  TORCH_CHECK(gate_up.device().is_cpu() && down.device().is_cpu() && gate_up.dim() == 3 && down.dim() == 3 &&
                  gate_up.scalar_type() == dtype && down.scalar_type() == dtype && gate_up.stride(2) == 1 &&
                  down.stride(2) == 1,
              "moe_experts: gate_up (E, 2I, H) and down (E, H, I) CPU tensors of x's ", dtype,
              ", each row contiguous; got ", gate_up.scalar_type(), " ", gate_up.sizes(), " strides ",
              gate_up.strides(), " and ", down.scalar_type(), " ", down.sizes(), " strides ", down.strides());
  const int64_t experts = gate_up.size(0), tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(down.size(0) == experts && gate_up.size(2) == hidden && down.size(1) == hidden &&
                  gate_up.size(1) == 2 * down.size(2),
              "moe_experts: x (", tokens, ", ", hidden, ") against gate_up ", gate_up.sizes(), " and down ",
              down.sizes(), ": they must be (E, 2I, ", hidden, ") and (E, ", hidden, ", I)");
  TORCH_CHECK(index.device().is_cpu() && index.scalar_type() == at::kLong && index.dim() == 2 &&
                  index.size(0) == tokens && index.is_contiguous(),
              "moe_experts: index a contiguous int64 (", tokens, ", k) CPU tensor, got ", index.scalar_type(), " ",
              index.sizes());
  TORCH_CHECK(weights.device().is_cpu() && weights.scalar_type() == dtype && weights.sizes() == index.sizes() &&
                  weights.is_contiguous(),
              "moe_experts: weights a contiguous ", dtype, " tensor of index's shape ", index.sizes(), ", got ",
              weights.scalar_type(), " ", weights.sizes());
  const int64_t* chosen = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < index.numel(); ++i)
    TORCH_CHECK(chosen[i] >= 0 && chosen[i] < experts, "moe_experts: expert ", chosen[i], " (entry ", i,
                " of index) is outside the ", experts, " experts");
  auto out = at::empty({tokens, hidden}, x.options());
  dtype == at::kBFloat16 ? run<BF16>(x, chosen, weights, gate_up, down, gelu, out)
                         : run<F32>(x, chosen, weights, gate_up, down, gelu, out);
  return out;
}

}  // namespace hybridkv_moe_decode
}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridkv, m) {
  m.def("moe_experts(Tensor x, Tensor index, Tensor weights, Tensor gate_up, Tensor down, str act) -> Tensor",
        &hybridkv_moe_decode::moe_experts);
}
