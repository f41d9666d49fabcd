// RMS norm (bf16 or fp32) in one pass over each row, with the residual add after it fused in, or gated by a SiLU
// (hybridkv.engine.ops.rms_norm).
//
// Row r of x (rows, D) -> x_r * inv_r * scale_b, inv_r = 1 / sqrt(mean(x_r^2) + eps), the mean of squares summed in
// fp64 (so inv_r is the correctly rounded fp32 value, at least as close to it as torch's fp32 sum), products in
// fp32 in torch's order ((x * inv) * scale), rounded to x's dtype once (bf16: round to nearest even). scale is fp32
// (blocks, D); row r takes block r % blocks (per-head scales of q/k norms over (T, heads, D)). With a residual
// (rows, D) of x's dtype: residual + that rounded norm, in fp32 rounded to the dtype: what torch's add of the two
// gives, bit for bit.
//
// Gated (GatedDeltaNet's output norm, transformers' Qwen3NextRMSNormGated): the same inv_r, then
// round(round(w * round(x_r * inv_r)) * silu(z)), gated.h's silu in fp32 (z / (1 + exp(-z)), ~1 ulp), w and z
// of x's dtype; z read through its strides (T, A, B, D), row r of x its (r / AB, r / B % A, r % B): the layer's gate
// is a view of its projection, which a reshape would copy.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

#include "gated.h"
#include "numerics.h"

namespace {  // internal linkage: inlined freely (a shared library's exported functions are not)
namespace hybridkv_rms_norm {

using namespace hybridkv_cpu;

template <typename T>
float inverse_rms(const T* x, int64_t d, float eps) {
  double squares = 0.0;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < d; ++i) {
    const double v = load(x[i]);
    squares += v * v;
  }
  return 1.0f / std::sqrt(static_cast<float>(squares / static_cast<double>(d)) + eps);
}

template <typename T>
void norm_row(const T* x, const float* scale, const T* residual, T* out, int64_t d, float eps) {
  const float inv = inverse_rms(x, d, eps);
  if (residual == nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) store(out + i, load(x[i]) * inv * scale[i]);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) {
      T normed;
      store(&normed, load(x[i]) * inv * scale[i]);
      store(out + i, load(residual[i]) + load(normed));
    }
  }
}

template <typename T>
void gated_row(const T* x, const T* w, const T* z, T* out, int64_t d, float eps) {
  const float inv = inverse_rms(x, d, eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    T normed, weighted;
    store(&normed, load(x[i]) * inv);
    store(&weighted, load(w[i]) * load(normed));
    store(out + i, load(weighted) * silu(load(z[i])));
  }
}

template <typename T>
void norm_rows(const at::Tensor& x, const at::Tensor& scale, const std::optional<at::Tensor>& residual,
               at::Tensor& out, float eps) {
  const int64_t d = x.size(-1), rows = x.numel() / d, blocks = scale.numel() / d;
  const auto* src = static_cast<const T*>(x.data_ptr());
  const T* res = residual.has_value() ? static_cast<const T*>(residual->data_ptr()) : nullptr;
  const float* sc = scale.data_ptr<float>();
  auto* dst = static_cast<T*>(out.data_ptr());
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      norm_row(src + r * d, sc + (r % blocks) * d, res == nullptr ? nullptr : res + r * d, dst + r * d, d, eps);
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& scale, double eps, const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) &&
                  x.is_contiguous() && x.dim() >= 1,
              "rms_norm: a contiguous bf16 or fp32 CPU x (..., D), got ", x.scalar_type(), " ", x.sizes());
  const int64_t d = x.size(-1);
  TORCH_CHECK(scale.device().is_cpu() && scale.scalar_type() == at::kFloat && scale.is_contiguous() && d > 0 &&
                  scale.numel() % d == 0 &&
                  scale.numel() > 0,
              "rms_norm: a contiguous fp32 CPU scale of whole rows of D = ", d, " (got ", scale.numel(), " entries)");
  const int64_t rows = x.numel() / d, blocks = scale.numel() / d;
  TORCH_CHECK(rows % blocks == 0, "rms_norm: ", rows, " rows are not a multiple of the scale's ", blocks, " rows");
  if (residual.has_value())
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type() &&
                    residual->is_contiguous(),
                "rms_norm: the residual must be a contiguous ", x.scalar_type(), " tensor of x's shape ", x.sizes(),
                ", got ", residual->scalar_type(), " ", residual->sizes());
  auto out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat)
    norm_rows<float>(x, scale, residual, out, static_cast<float>(eps));
  else
    norm_rows<uint16_t>(x, scale, residual, out, static_cast<float>(eps));
  return out;
}

at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& gate, double eps) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) &&
                  x.is_contiguous() && x.dim() >= 1,
              "gated_rms_norm: a contiguous bf16 or fp32 CPU x (..., D), got ", x.scalar_type(), " ", x.sizes());
  const int64_t d = x.size(-1), rows = d > 0 ? x.numel() / d : 0;
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == d,
              "gated_rms_norm: a contiguous CPU weight of x's ", x.scalar_type(), " and D = ", d, " entries, got ",
              weight.scalar_type(), " ", weight.sizes());
  TORCH_CHECK(gate.device().is_cpu() && gate.scalar_type() == x.scalar_type() && gate.dim() == 4 &&
                  gate.size(3) == d && gate.stride(3) == 1 && gate.size(0) * gate.size(1) * gate.size(2) == rows,
              "gated_rms_norm: a ", x.scalar_type(), " gate (T, A, B, ", d, ") of ", rows,
              " rows, each contiguous, got ", gate.scalar_type(), " ", gate.sizes(), " strides ", gate.strides());
  auto out = at::empty_like(x);
  const int64_t a = gate.size(1), b = gate.size(2);
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    const auto* src = static_cast<const T*>(x.data_ptr());
    const auto* w = static_cast<const T*>(weight.data_ptr());
    const auto* z = static_cast<const T*>(gate.data_ptr());
    auto* dst = static_cast<T*>(out.data_ptr());
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* zr = z + (r / (a * b)) * gate.stride(0) + (r / b % a) * gate.stride(1) + (r % b) * gate.stride(2);
        gated_row(src + r * d, w, zr, dst + r * d, d, static_cast<float>(eps));
      }
    });
  };
  if (x.scalar_type() == at::kFloat)
    run(float{});
  else
    run(uint16_t{});
  return out;
}

}  // namespace hybridkv_rms_norm
}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridkv, m) {
  m.def("rms_norm(Tensor x, Tensor scale, float eps, Tensor? residual) -> Tensor", &hybridkv_rms_norm::rms_norm);
  m.def("gated_rms_norm(Tensor x, Tensor weight, Tensor gate, float eps) -> Tensor",
        &hybridkv_rms_norm::gated_rms_norm);
}
