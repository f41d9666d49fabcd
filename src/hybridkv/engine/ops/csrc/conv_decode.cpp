// One decode step of a depthwise causal conv1d whose windows are updated where they lie in the state pool
// (hybridkv.engine.ops.conv_cells), SiLU or no activation after it.
//
// Row r, channel c: the window w = pool[cells[r], c] (K - 1 inputs, oldest first) and the new input x[r, c] are
// the K taps; out[r, c] = act(sum_t tap_t * weight[c, t]) in fp32 (the taps' sum in order t = 0 .. K - 1), rounded
// once to x's dtype; the window becomes taps 1 .. K - 1 (the new input last), written in the pool. bf16 or fp32 x
// and windows (one dtype), an fp32 weight (C, K). The torch path (ops.conv.causal_conv1d_decode with fp32 taps) makes
// the same products; its sum's order and its SiLU's exp may differ: equal within fp32 rounding before the output's.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <cstdint>

#include "cells.h"
#include "numerics.h"

namespace {
namespace hybridkv_conv_decode {

using namespace hybridkv_cpu;

template <typename T>
void conv_rows(const at::Tensor& x, const at::Tensor& weight, at::Tensor& pool, const int64_t* cell, at::Tensor& out,
               bool silu) {
  const int64_t rows = x.size(0), channels = x.size(1), kernel = weight.size(1), cell_stride = pool.stride(0);
  const auto* xp = static_cast<const T*>(x.data_ptr());
  const float* wp = weight.data_ptr<float>();
  auto* pp = static_cast<T*>(pool.data_ptr());
  auto* op = static_cast<T*>(out.data_ptr());
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* window = pp + cell[r] * cell_stride;
      for (int64_t c = 0; c < channels; ++c) {
        T* w = window + c * (kernel - 1);
        const float* wc = wp + c * kernel;
        const float newest = load(xp[r * channels + c]);
        float acc = 0.0f;
        for (int64_t t = 0; t < kernel - 1; ++t) acc += load(w[t]) * wc[t];
        acc += newest * wc[kernel - 1];
        if (silu) acc = acc / (1.0f + exp_approx(-acc));
        store(op + r * channels + c, acc);
        for (int64_t t = 0; t + 1 < kernel - 1; ++t) w[t] = w[t + 1];
        w[kernel - 2] = xp[r * channels + c];
      }
    }
  });
}

at::Tensor conv_decode_cells(const at::Tensor& x, const at::Tensor& weight, at::Tensor& pool, const at::Tensor& cells,
                             bool silu) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) &&
                  x.dim() == 2 && x.is_contiguous(),
              "conv_decode_cells: a contiguous bf16 or fp32 CPU x (R, C), got ", x.scalar_type(), " ", x.sizes());
  const int64_t rows = x.size(0), channels = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.dim() == 2 &&
                  weight.size(0) == channels && weight.size(1) >= 2,
              "conv_decode_cells: a contiguous fp32 weight (C = ", channels, ", K >= 2), got ", weight.scalar_type(),
              " ", weight.sizes());
  const int64_t kernel = weight.size(1);
  TORCH_CHECK(pool.device().is_cpu() && pool.scalar_type() == x.scalar_type() && pool.dim() == 3 &&
                  pool.size(1) == channels && pool.size(2) == kernel - 1 && pool.stride(2) == 1 &&
                  pool.stride(1) == kernel - 1,
              "conv_decode_cells: a pool of ", x.scalar_type(), " windows (cells, ", channels, ", ", kernel - 1,
              ") contiguous in each cell, got ", pool.scalar_type(), " ", pool.sizes(), " strides ", pool.strides());
  const int64_t* cell = checked_cells(cells, rows, pool.size(0), "conv_decode_cells");
  auto out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat)
    conv_rows<float>(x, weight, pool, cell, out, silu);
  else
    conv_rows<uint16_t>(x, weight, pool, cell, out, silu);
  return out;
}

}  // namespace hybridkv_conv_decode
}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridkv, m) {
  m.def("conv_decode_cells(Tensor x, Tensor weight, Tensor(a!) pool, Tensor cells, bool silu) -> Tensor",
        &hybridkv_conv_decode::conv_decode_cells);
}
