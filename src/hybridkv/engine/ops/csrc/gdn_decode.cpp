// One decode step of the gated delta rule (GatedDeltaNet) on fp32 states updated where they are in the state pool
// (hybridkv.engine.ops.gdn_cells).
//
// Row r, head h: S = pool[cells[r], h] (dk, dv), read and written in place (no gathered copy, no state-sized
// temporary); with q, k (dk) already L2-normalised (q scaled), v (dv), decay a = exp(g), beta b:
//   kS_j = sum_i k_i (a S_ij);  d_j = (v_j - kS_j) b;  S_ij = a S_ij + k_i d_j;  o_j = sum_i q_i S_ij (the new S).
// Two passes over S (one read; one read and write) where the torch path makes six. The same products as the torch
// path (decay first, then each sum), the sums over i in order: equal within fp32 rounding, not bit-equal.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cells.h"

namespace {
namespace hybridkv_gdn_decode {

void head_step(float* s, const float* q, const float* k, const float* v, float a, float b, float* o, float* tmp,
               int64_t dk, int64_t dv) {
  for (int64_t j = 0; j < dv; ++j) tmp[j] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    const float ki = k[i];
    const float* row = s + i * dv;
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) tmp[j] += ki * (a * row[j]);
  }
#pragma omp simd
  for (int64_t j = 0; j < dv; ++j) {
    tmp[j] = (v[j] - tmp[j]) * b;
    o[j] = 0.0f;
  }
  for (int64_t i = 0; i < dk; ++i) {
    const float ki = k[i], qi = q[i];
    float* row = s + i * dv;
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) {
      const float updated = a * row[j] + ki * tmp[j];
      row[j] = updated;
      o[j] += qi * updated;
    }
  }
}

at::Tensor gdn_decode_cells(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, at::Tensor& pool, const at::Tensor& cells) {
  TORCH_CHECK(q.dim() == 3 && q.sizes() == k.sizes() && v.dim() == 3 && v.size(0) == q.size(0) &&
                  v.size(1) == q.size(1),
              "gdn_decode_cells: q, k (R, H, dk) and v (R, H, dv), got ", q.sizes(), " ", k.sizes(), " ", v.sizes());
  const int64_t rows = q.size(0), heads = q.size(1), dk = q.size(2), dv = v.size(2);
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "gdn_decode_cells: q, k, v, g, beta must be contiguous fp32 CPU tensors, got ", t->scalar_type());
  TORCH_CHECK(g.numel() == rows * heads && beta.numel() == rows * heads,
              "gdn_decode_cells: g and beta (R, H) = (", rows, ", ", heads, "), got ", g.sizes(), " ", beta.sizes());
  TORCH_CHECK(pool.device().is_cpu() && pool.scalar_type() == at::kFloat && pool.dim() == 4 && pool.size(1) == heads &&
                  pool.size(2) == dk && pool.size(3) == dv && pool.stride(3) == 1 && pool.stride(2) == dv &&
                  pool.stride(1) == dk * dv,
              "gdn_decode_cells: an fp32 pool (cells, ", heads, ", ", dk, ", ", dv,
              ") whose cells' states are contiguous, got ", pool.scalar_type(), " ", pool.sizes(), " strides ",
              pool.strides());
  const int64_t* cell = hybridkv_cpu::checked_cells(cells, rows, pool.size(0), "gdn_decode_cells");
  auto out = at::empty({rows, heads, dv}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* sp = pool.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t cell_stride = pool.stride(0);
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(dv);
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / heads, h = rh % heads;
      float* s = sp + cell[r] * cell_stride + h * dk * dv;
      head_step(s, qp + rh * dk, kp + rh * dk, vp + rh * dv, std::exp(gp[rh]), bp[rh], op + rh * dv, tmp.data(), dk,
                dv);
    }
  });
  return out;
}

}  // namespace hybridkv_gdn_decode
}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridkv, m) {
  m.def("gdn_decode_cells(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) pool, Tensor cells) -> Tensor",
        &hybridkv_gdn_decode::gdn_decode_cells);
}
