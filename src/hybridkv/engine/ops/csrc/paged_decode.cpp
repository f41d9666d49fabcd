// One-token (decode) attention read straight from the pool's pages: no gathered copy of the keys
// (hybridkv.engine.ops.paged_decode, which says when the engine takes it).
//
// Row r's query heads (H, D) attend over its columns [start[r], stop[r]): column c is slot c % page of the cell
// table[r, c / page] in the grid (cells, slots, page, kv_heads, D); query head h reads kv head h / (H / kv_heads).
// Entries are bf16 or fp32 (q and grid alike). Scores q . k (bf16 products summed in fp32: VDPBF16PS pairs where
// the CPU has AVX512-BF16; fp32 ones by 16-lane FMAs), times scale, softmax in fp32 (a vectorised exp, Cephes'
// polynomial, ~1 ulp), the weighted sum of values in fp32, rounded to the entries' type once at the end.
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

#if defined(__AVX512F__)
// 16 entries from `at` as fp32 lanes
HYBRIDKV_INLINE __m512 lanes(const uint16_t* at) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
HYBRIDKV_INLINE __m512 lanes(const float* at) { return _mm512_loadu_ps(at); }
#endif

// q . k over d entries, in fp32
HYBRIDKV_INLINE float dot(const uint16_t* q, const uint16_t* k, int64_t d) { return dot_bf16(q, k, d); }
HYBRIDKV_INLINE float dot(const float* q, const float* k, int64_t d) {
  int64_t i = 0;
  float dot = 0.0f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), acc);
  dot = _mm512_reduce_add_ps(acc);
#endif
  for (; i < d; ++i) dot += q[i] * k[i];  // a plain loop: see dot_bf16 on an empty `omp simd` tail
  return dot;
}

// T: the entries' storage, uint16_t (bf16 bits) or float
template <typename T>
void attend(const at::Tensor& q, const at::Tensor& grid, int64_t k_slot, int64_t v_slot, const at::Tensor& table,
            const at::Tensor& start, const at::Tensor& stop, double scale, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t page = grid.size(2), kv_heads = grid.size(3);
  const int64_t group = heads / kv_heads, width = table.size(1);
  const int64_t cell_stride = grid.stride(0), slot_stride = grid.stride(1);
  const auto* base = reinterpret_cast<const T*>(grid.data_ptr());
  const auto* qs = reinterpret_cast<const T*>(q.data_ptr());
  auto* os = reinterpret_cast<T*>(out.data_ptr());
  const int64_t* tab = table.data_ptr<int64_t>();
  const int64_t* lo = start.data_ptr<int64_t>();
  const int64_t* hi = stop.data_ptr<int64_t>();
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(group * d), scores, total(group);
    std::vector<const T*> keys, values;  // each column's key and value entries
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, h = task % kv_heads, n = hi[r] - lo[r];
      const T* qh = qs + (r * heads + h * group) * d;
      scores.resize(group * n);
      keys.resize(n);
      values.resize(n);
      for (int64_t c = 0; c < n; ++c) {
        const int64_t col = lo[r] + c;
        const T* entry = base + tab[r * width + col / page] * cell_stride + ((col % page) * kv_heads + h) * d;
        keys[c] = entry + k_slot * slot_stride;
        values[c] = entry + v_slot * slot_stride;
      }
      for (int64_t c = 0; c < n; ++c) {
        if (c + kAhead < n) {  // the pages are scattered: fetch a later column's key and value while this one computes
          for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(T)); b += 64) {
            __builtin_prefetch(reinterpret_cast<const char*>(keys[c + kAhead]) + b);
            __builtin_prefetch(reinterpret_cast<const char*>(values[c + kAhead]) + b);
          }
        }
        for (int64_t j = 0; j < group; ++j) scores[j * n + c] = dot(qh + j * d, keys[c], d) * static_cast<float>(scale);
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
            const __m512 weight = _mm512_set1_ps(w[c]);
            a0 = _mm512_fmadd_ps(weight, lanes(values[c] + x0), a0);
            a1 = _mm512_fmadd_ps(weight, lanes(values[c] + x0 + 16), a1);
          }
          _mm512_storeu_ps(a + x0, a0);
          _mm512_storeu_ps(a + x0 + 16, a1);
        }
#endif
        for (; x0 < d; ++x0) {
          float sum = 0.0f;
          for (int64_t c = 0; c < n; ++c) sum += w[c] * load(values[c][x0]);
          a[x0] = sum;
        }
        T* o = os + (r * heads + h * group + j) * d;
        const float inv = total[j];
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) store(o + i, a[i] / inv);
      }
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& grid, int64_t k_slot, int64_t v_slot,
                        const at::Tensor& table, const at::Tensor& start, const at::Tensor& stop, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "paged_decode: bf16 or fp32 queries, got ", q.scalar_type());
  TORCH_CHECK(grid.scalar_type() == q.scalar_type(), "paged_decode: queries of ", q.scalar_type(), " over a grid of ",
              grid.scalar_type(), "; cast the queries to the pool's dtype");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "paged_decode: contiguous (rows, heads, D) queries");
  TORCH_CHECK(grid.dim() == 5 && grid.stride(4) == 1 && grid.stride(3) == grid.size(4) &&
                  grid.stride(2) == grid.size(3) * grid.size(4),
              "paged_decode: a grid (cells, slots, page, kv_heads, D), each page's entries contiguous");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong && table.is_contiguous() &&
                  start.scalar_type() == at::kLong && stop.scalar_type() == at::kLong && start.is_contiguous() &&
                  stop.is_contiguous(),
              "paged_decode: int64 table (rows, pages), start and stop (rows,)");
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t page = grid.size(2), kv_heads = grid.size(3), cells = grid.size(0);
  TORCH_CHECK(grid.size(4) == d && heads % kv_heads == 0 && table.size(0) == rows && start.size(0) == rows &&
                  stop.size(0) == rows && 0 <= k_slot && k_slot < grid.size(1) && 0 <= v_slot && v_slot < grid.size(1),
              "paged_decode: shapes disagree");
  const int64_t width = table.size(1);
  const int64_t* tab = table.data_ptr<int64_t>();
  const int64_t* lo = start.data_ptr<int64_t>();
  const int64_t* hi = stop.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {  // bounds checked here, before any read
    TORCH_CHECK(0 <= lo[r] && lo[r] < hi[r] && hi[r] <= width * page, "paged_decode: row ", r, " columns out of range");
    for (int64_t p = lo[r] / page; p <= (hi[r] - 1) / page; ++p)
      TORCH_CHECK(0 <= tab[r * width + p] && tab[r * width + p] < cells, "paged_decode: row ", r, " cell out of range");
  }
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat)
    attend<float>(q, grid, k_slot, v_slot, table, start, stop, scale, out);
  else
    attend<uint16_t>(q, grid, k_slot, v_slot, table, start, stop, scale, out);
  return out;
}

}  // namespace hybridkv_paged_decode
}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridkv, m) {
  m.def("paged_decode(Tensor q, Tensor grid, int k_slot, int v_slot, Tensor table, Tensor start, Tensor stop, float scale) -> Tensor", &hybridkv_paged_decode::paged_decode);
}
