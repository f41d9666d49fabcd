// A depthwise causal conv1d over a padded batch of chunks whose windows are read and updated where they lie in the
// state pool (hybridkv.engine.ops.conv_cells), SiLU or no activation after it.
//
// Row r continues the window w = pool[cells[r]] (C, K - 1: the last K - 1 inputs, oldest first) with its lengths[r]
// inputs x[r, :lengths[r]] (R, Q, C): out[r, q, c] = act(sum_t in(q - K + 1 + t, c) * weight[c, t]) in fp32, the
// taps' sum in order t = 0 .. K - 1, rounded once to x's dtype (in(p) = x[r, p] for p >= 0, w[K - 1 + p] before);
// outputs past lengths[r] are unspecified. The window becomes the last K - 1 inputs up to lengths[r] (from the old
// window where the chunk is shorter), written in the pool. The torch path (ops.conv.causal_conv1d_prefill with fp32
// taps) makes the same products; its sums may fuse differently and its SiLU's exp differs: within fp32 rounding
// before the output's.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

#include "cells.h"
#include "numerics.h"

namespace {
namespace hybridkv_conv_prefill {

using namespace hybridkv_cpu;

template <typename T>
void conv_rows(const at::Tensor& x, const at::Tensor& weight, at::Tensor& pool, const int64_t* cell,
               const int64_t* length, at::Tensor& out, bool silu) {
  const int64_t rows = x.size(0), width = x.size(1), channels = x.size(2), kernel = weight.size(1);
  const int64_t keep = kernel - 1, cell_stride = pool.stride(0);
  std::vector<float> taps(kernel * channels);  // (K, C): a tap's weights contiguous over channels
  const float* wp = weight.data_ptr<float>();
  for (int64_t c = 0; c < channels; ++c)
    for (int64_t t = 0; t < kernel; ++t) taps[t * channels + c] = wp[c * kernel + t];
  const auto* xp = static_cast<const T*>(x.data_ptr());
  auto* pp = static_cast<T*>(pool.data_ptr());
  auto* op = static_cast<T*>(out.data_ptr());
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(channels), head(keep * channels);  // head: the window as (K - 1, C), fp32
    for (int64_t r = begin; r < end; ++r) {
      T* window = pp + cell[r] * cell_stride;
      const T* xr = xp + r * width * channels;
      T* orow = op + r * width * channels;
      for (int64_t j = 0; j < keep; ++j)
        for (int64_t c = 0; c < channels; ++c) head[j * channels + c] = load(window[c * keep + j]);
      for (int64_t q = 0; q < width; ++q) {
        for (int64_t t = 0; t < kernel; ++t) {
          const int64_t p = q - keep + t;  // the input position of tap t
          const float* wt = taps.data() + t * channels;
          if (p >= 0) {
            const T* in = xr + p * channels;
            if (t == 0) {
#pragma omp simd
              for (int64_t c = 0; c < channels; ++c) acc[c] = load(in[c]) * wt[c];
            } else {
#pragma omp simd
              for (int64_t c = 0; c < channels; ++c) acc[c] += load(in[c]) * wt[c];
            }
          } else {
            const float* in = head.data() + (keep + p) * channels;
            if (t == 0) {
#pragma omp simd
              for (int64_t c = 0; c < channels; ++c) acc[c] = in[c] * wt[c];
            } else {
#pragma omp simd
              for (int64_t c = 0; c < channels; ++c) acc[c] += in[c] * wt[c];
            }
          }
        }
        T* o = orow + q * channels;
        if (silu) {
#pragma omp simd
          for (int64_t c = 0; c < channels; ++c) store(o + c, acc[c] / (1.0f + exp_approx(-acc[c])));
        } else {
#pragma omp simd
          for (int64_t c = 0; c < channels; ++c) store(o + c, acc[c]);
        }
      }
      const int64_t n = length[r];
      for (int64_t j = 0; j < keep; ++j) {  // new window slot j holds input position n - keep + j
        const int64_t p = n - keep + j;
        for (int64_t c = 0; c < channels; ++c) {
          if (p >= 0)
            window[c * keep + j] = xr[p * channels + c];
          else
            store(window + c * keep + j, head[(keep + p) * channels + c]);
        }
      }
    }
  });
}

at::Tensor conv_prefill_cells(const at::Tensor& x, const at::Tensor& weight, at::Tensor& pool, const at::Tensor& cells,
                              const at::Tensor& lengths, bool silu) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) &&
                  x.dim() == 3 && x.is_contiguous(),
              "conv_prefill_cells: a contiguous bf16 or fp32 CPU x (R, Q, C), got ", x.scalar_type(), " ", x.sizes());
  const int64_t rows = x.size(0), width = x.size(1), channels = x.size(2);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.dim() == 2 &&
                  weight.size(0) == channels && weight.size(1) >= 2,
              "conv_prefill_cells: a contiguous fp32 weight (C = ", channels, ", K >= 2), got ", weight.scalar_type(),
              " ", weight.sizes());
  const int64_t kernel = weight.size(1);
  TORCH_CHECK(pool.device().is_cpu() && pool.scalar_type() == x.scalar_type() && pool.dim() == 3 &&
                  pool.size(1) == channels && pool.size(2) == kernel - 1 && pool.stride(2) == 1 &&
                  pool.stride(1) == kernel - 1,
              "conv_prefill_cells: a pool of ", x.scalar_type(), " windows (cells, ", channels, ", ", kernel - 1,
              ") contiguous in each cell, got ", pool.scalar_type(), " ", pool.sizes(), " strides ", pool.strides());
  const int64_t* cell = checked_cells(cells, rows, pool.size(0), "conv_prefill_cells");
  TORCH_CHECK(lengths.device().is_cpu() && lengths.scalar_type() == at::kLong && lengths.dim() == 1 &&
                  lengths.size(0) == rows && lengths.is_contiguous(),
              "conv_prefill_cells: lengths must be a contiguous int64 (R = ", rows, ",) tensor, got ",
              lengths.scalar_type(), " ", lengths.sizes());
  const int64_t* length = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(length[r] >= 0 && length[r] <= width, "conv_prefill_cells: length ", length[r], " of row ", r,
                " is outside the chunk's 0 .. ", width, " inputs");
  auto out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat)
    conv_rows<float>(x, weight, pool, cell, length, out, silu);
  else
    conv_rows<uint16_t>(x, weight, pool, cell, length, out, silu);
  return out;
}

}  // namespace hybridkv_conv_prefill
}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridkv, m) {
  m.def("conv_prefill_cells(Tensor x, Tensor weight, Tensor(a!) pool, Tensor cells, Tensor lengths, bool silu) -> Tensor",
        &hybridkv_conv_prefill::conv_prefill_cells);
}
