// x @ weight.T (+ bias) for a few rows of x (hybridkv.engine.ops.skinny_linear): a decode step's projections and
// logits, where the weight is read once from memory and the matmul library's fixed cost per call dominates small
// shapes.
//
// x (M, K) contiguous, M in 1..GEMV_MAX_X; weight (N, K), each row contiguous (a row stride of its own: one expert of
// a stacked tensor); bias (N,) or none; all bf16 or all fp32. The products and their rounding: gemv.h. Output rows
// are split among the threads (at::parallel_for).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

#include "gemv.h"
#include "numerics.h"

namespace {  // internal linkage: inlined freely (a shared library's exported functions are not)
namespace hybridkv_skinny_linear {

using namespace hybridkv_cpu;

template <class L>
void run(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  using T = typename L::T;
  gemv_rows<L>(static_cast<const T*>(x.data_ptr()), x.size(0), static_cast<const T*>(weight.data_ptr()),
               weight.stride(0), bias ? static_cast<const T*>(bias->data_ptr()) : nullptr,
               static_cast<T*>(out.data_ptr()), x.size(1), weight.size(0));
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && x.dim() == 2 && weight.dim() == 2,
              "skinny_linear: CPU x (M, K) and weight (N, K), got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= GEMV_MAX_X, "skinny_linear: x has 1 to ", GEMV_MAX_X, " rows, got ",
              x.size(0));
  TORCH_CHECK(x.size(1) == weight.size(1), "skinny_linear: x's ", x.size(1), " columns against the weight's ",
              weight.size(1), ": they must be equal");
  TORCH_CHECK(x.is_contiguous() && weight.stride(1) == 1, "skinny_linear: x contiguous and each weight row "
              "contiguous, got strides ", x.strides(), " and ", weight.strides());
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && weight.scalar_type() == dtype,
              "skinny_linear: x and weight both bf16 or both fp32, got ", dtype, " and ", weight.scalar_type());
  if (bias)
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == dtype && bias->dim() == 1 &&
                    bias->size(0) == weight.size(0) && bias->is_contiguous(),
                "skinny_linear: bias a contiguous (", weight.size(0), ",) ", dtype, " tensor, got ",
                bias->scalar_type(), " ", bias->sizes());
  auto out = at::empty({x.size(0), weight.size(0)}, x.options());
  dtype == at::kBFloat16 ? run<BF16>(x, weight, bias, out) : run<F32>(x, weight, bias, out);
  return out;
}

}  // namespace hybridkv_skinny_linear
}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridkv, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &hybridkv_skinny_linear::skinny_linear);
}
