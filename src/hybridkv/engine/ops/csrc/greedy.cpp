// Greedy choice over CPU logits in one read: per row the index of the first largest logit, or -1 where the row
// holds NaN or an infinity (hybridkv.engine.ops.greedy; torch's argmax and isfinite().all() read a row three times,
// the bf16 forms without vector code).
//
// Per row: pass 1 takes the maximum and ORs an "exponent all ones" flag over every entry (NaN and +-inf); pass 2
// finds the first entry equal to the maximum, a block of vector compares at a time (a row is 64 KB of bf16 at 32k
// ids: still in cache). Equal values compare equal whatever their bits (-0 == +0), so the index is argmax's: the
// first of the largest.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>

#include "numerics.h"

namespace {  // internal linkage: inlined freely (a shared library's exported functions are not)
namespace hybridkv_greedy {

using namespace hybridkv_cpu;

constexpr int64_t kBlock = 256;

int64_t row_bf16(const uint16_t* row, int64_t n) {
  float top = -INFINITY;
  uint32_t bad = 0;
#pragma omp simd reduction(max : top) reduction(| : bad)
  for (int64_t i = 0; i < n; ++i) {
    bad |= static_cast<uint32_t>((row[i] & 0x7F80u) == 0x7F80u);
    const float v = bf16_to_float(row[i]);
    top = v > top ? v : top;
  }
  if (bad) return -1;
  for (int64_t block = 0; block < n; block += kBlock) {  // which block holds the first maximum: vector compares
    const int64_t end = std::min(n, block + kBlock);
    uint32_t hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t i = block; i < end; ++i) hit |= static_cast<uint32_t>(bf16_to_float(row[i]) == top);
    if (hit)
      for (int64_t i = block; i < end; ++i)
        if (bf16_to_float(row[i]) == top) return i;
  }
  return -1;
}

int64_t row_f32(const float* row, int64_t n) {
  float top = -INFINITY;
  uint32_t bad = 0;
#pragma omp simd reduction(max : top) reduction(| : bad)
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, row + i, sizeof(bits));
    bad |= static_cast<uint32_t>((bits & 0x7F800000u) == 0x7F800000u);
    top = row[i] > top ? row[i] : top;
  }
  if (bad) return -1;
  for (int64_t block = 0; block < n; block += kBlock) {
    const int64_t end = std::min(n, block + kBlock);
    uint32_t hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t i = block; i < end; ++i) hit |= static_cast<uint32_t>(row[i] == top);
    if (hit)
      for (int64_t i = block; i < end; ++i)
        if (row[i] == top) return i;
  }
  return -1;
}

at::Tensor greedy(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous(),
              "greedy: contiguous (rows, vocab) CPU logits");
  TORCH_CHECK(logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat,
              "greedy: bfloat16 or float32 logits");
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = at::empty({rows}, at::TensorOptions().dtype(at::kLong));
  int64_t* picked = out.data_ptr<int64_t>();
  const bool bf16 = logits.scalar_type() == at::kBFloat16;
  const void* data = logits.data_ptr();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      picked[r] = bf16 ? row_bf16(static_cast<const uint16_t*>(data) + r * n, n)
                       : row_f32(static_cast<const float*>(data) + r * n, n);
  });
  return out;
}

}  // namespace hybridkv_greedy
}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridkv, m) {
  m.def("greedy(Tensor logits) -> Tensor", &hybridkv_greedy::greedy);
}
