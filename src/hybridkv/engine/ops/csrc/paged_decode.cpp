// One-token (decode) attention read straight from the pool's pages: no gathered copy of the keys
// (hybridkv.engine.ops.paged_decode, which says when the engine takes it).
//
// Row r's query heads (H, D) attend over its columns [start[r], stop[r]): column c is slot c % page of the cell
// table[r, c / page] in the grid (cells, slots, page, kv_heads, D); query head h reads kv head h / (H / kv_heads).
// Scores q . k (bf16 products summed in fp32: VDPBF16PS pairs where the CPU has AVX512-BF16), times scale, softmax
// in fp32 (a vectorised exp, Cephes' polynomial, ~1 ulp), the weighted sum of values in fp32, rounded to bf16 once
// at the end.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "numerics.h"

namespace {  // internal linkage: inlined freely (a shared library's exported functions are not)
namespace hybridkv_paged_decode {

using namespace hybridkv_cpu;

constexpr int64_t kAhead = 8;  // columns a score looks ahead to prefetch

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& grid, int64_t k_slot, int64_t v_slot,
                           const at::Tensor& table, const at::Tensor& start, const at::Tensor& stop,
                           double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.is_contiguous(),
              "paged_decode: contiguous (rows, heads, D) bf16 queries");
  TORCH_CHECK(grid.dim() == 5 && grid.scalar_type() == at::kBFloat16 && grid.stride(4) == 1 &&
                  grid.stride(3) == grid.size(4) && grid.stride(2) == grid.size(3) * grid.size(4),
              "paged_decode: a bf16 grid (cells, slots, page, kv_heads, D), each page's entries contiguous");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong && table.is_contiguous() &&
                  start.scalar_type() == at::kLong && stop.scalar_type() == at::kLong && start.is_contiguous() &&
                  stop.is_contiguous(),
              "paged_decode: int64 table (rows, pages), start and stop (rows,)");
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t page = grid.size(2), kv_heads = grid.size(3), cells = grid.size(0);
  TORCH_CHECK(grid.size(4) == d && heads % kv_heads == 0 && table.size(0) == rows && start.size(0) == rows &&
                  stop.size(0) == rows && 0 <= k_slot && k_slot < grid.size(1) && 0 <= v_slot && v_slot < grid.size(1),
              "paged_decode: shapes disagree");
  const int64_t group = heads / kv_heads, width = table.size(1);
  const int64_t cell_stride = grid.stride(0), slot_stride = grid.stride(1);
  const auto* base = reinterpret_cast<const uint16_t*>(grid.data_ptr());
  const auto* qs = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const int64_t* tab = table.data_ptr<int64_t>();
  const int64_t* lo = start.data_ptr<int64_t>();
  const int64_t* hi = stop.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {  // bounds checked here, before any read
    TORCH_CHECK(0 <= lo[r] && lo[r] < hi[r] && hi[r] <= width * page, "paged_decode: row ", r, " columns out of range");
    for (int64_t p = lo[r] / page; p <= (hi[r] - 1) / page; ++p)
      TORCH_CHECK(0 <= tab[r * width + p] && tab[r * width + p] < cells, "paged_decode: row ", r, " cell out of range");
  }
  auto out = at::empty_like(q);
  auto* os = reinterpret_cast<at::BFloat16*>(out.data_ptr());
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(group * d), scores, total(group);
    std::vector<const uint16_t*> keys, values;  // each column's key and value entries
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, h = task % kv_heads, n = hi[r] - lo[r];
      const uint16_t* qh = qs + (r * heads + h * group) * d;
      scores.resize(group * n);
      keys.resize(n);
      values.resize(n);
      for (int64_t c = 0; c < n; ++c) {
        const int64_t col = lo[r] + c;
        const uint16_t* entry = base + tab[r * width + col / page] * cell_stride + ((col % page) * kv_heads + h) * d;
        keys[c] = entry + k_slot * slot_stride;
        values[c] = entry + v_slot * slot_stride;
      }
      for (int64_t c = 0; c < n; ++c) {
        if (c + kAhead < n) {  // the pages are scattered: fetch a later column's key and value while this one computes
          for (int64_t b = 0; b < d * 2; b += 64) {
            __builtin_prefetch(reinterpret_cast<const char*>(keys[c + kAhead]) + b);
            __builtin_prefetch(reinterpret_cast<const char*>(values[c + kAhead]) + b);
          }
        }
        for (int64_t j = 0; j < group; ++j)
          scores[j * n + c] = dot_bf16(qh + j * d, keys[c], d) * static_cast<float>(scale);
      }
      for (int64_t j = 0; j < group; ++j) {
        float* s = scores.data() + j * n;
        float top = -INFINITY;
#pragma omp simd reduction(max : top)
        for (int64_t c = 0; c < n; ++c) top = s[c] > top ? s[c] : top;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < n; ++c) {
          s[c] = exp_approx(s[c] - top);
          sum += s[c];
        }
        total[j] = sum;
      }
      for (int64_t j = 0; j < group; ++j) {
        const float* w = scores.data() + j * n;
        float* a = acc.data() + j * d;
        int64_t x0 = 0;
#if defined(__AVX512F__)
        for (; x0 + 32 <= d; x0 += 32) {  // 32 outputs summed in two registers over the columns, in column order
          __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
          for (int64_t c = 0; c < n; ++c) {
            const uint16_t* value = values[c] + x0;
            const __m512 weight = _mm512_set1_ps(w[c]);
            const __m512i first = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(value)));
            const __m512i second =
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(value + 16)));
            a0 = _mm512_fmadd_ps(weight, _mm512_castsi512_ps(_mm512_slli_epi32(first, 16)), a0);
            a1 = _mm512_fmadd_ps(weight, _mm512_castsi512_ps(_mm512_slli_epi32(second, 16)), a1);
          }
          _mm512_storeu_ps(a + x0, a0);
          _mm512_storeu_ps(a + x0 + 16, a1);
        }
#endif
        for (; x0 < d; ++x0) {
          float sum = 0.0f;
          for (int64_t c = 0; c < n; ++c) sum += w[c] * bf16_to_float(values[c][x0]);
          a[x0] = sum;
        }
        uint16_t* o = reinterpret_cast<uint16_t*>(os) + (r * heads + h * group + j) * d;
        const float inv = total[j];
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) o[i] = float_to_bf16(a[i] / inv);
      }
    }
  });
  return out;
}

}  // namespace hybridkv_paged_decode
}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridkv, m) {
  m.def("paged_decode(Tensor q, Tensor grid, int k_slot, int v_slot, Tensor table, Tensor start, Tensor stop, float scale) -> Tensor", &hybridkv_paged_decode::paged_decode);
}
