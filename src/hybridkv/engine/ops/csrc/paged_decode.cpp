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
#include "paged.h"

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
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = grid.size(3);
  const int64_t group = heads / kv_heads;
  const PagedEntries<T> entries(grid, table, k_slot, v_slot);
  const auto* qs = reinterpret_cast<const T*>(q.data_ptr());
  auto* os = reinterpret_cast<T*>(out.data_ptr());
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
        keys[c] = entries.key(r, lo[r] + c, h);
        values[c] = entries.value(r, lo[r] + c, h);
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
  check_paged("paged_decode", q, grid, k_slot, v_slot, table, start, stop);
  TORCH_CHECK(table.size(0) == q.size(0), "paged_decode: a plan of ", table.size(0), " rows for ", q.size(0),
              " queries");
  const int64_t rows = q.size(0), width = table.size(1), page = grid.size(2);
  const int64_t* lo = start.data_ptr<int64_t>();
  const int64_t* hi = stop.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)  // bounds checked here, before any read
    TORCH_CHECK(0 <= lo[r] && lo[r] < hi[r] && hi[r] <= width * page, "paged_decode: row ", r, " columns out of range");
  check_cells("paged_decode", grid, table, start, stop);
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
