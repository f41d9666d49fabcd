// Attention of multi-token rows (prefill spans, a prompt's tail on a cached prefix) read straight from the pool's
// pages: no gathered copy of the keys, no padding, no mask tensor (hybridkv.engine.ops.paged_spans, which says when
// the engine takes it).
//
// Row r's queries are the flat tokens [q_begin[r], q_begin[r + 1]); its n tokens are its last n columns, query i at
// column c_i = stop[r] - n + i, and it sees columns [lo_i, c_i]: lo_i = start[r], or with a window w > 0
// max(start[r], c_i + 1 - w). Column c is slot c % page of the cell table[r, c / page] in the grid (cells, slots,
// page, kv_heads, D); query head h reads kv head h / (H / kv_heads). Entries bf16 or fp32 (q and grid alike).
//
// A task is one row, one kv head and up to kQueries of its query vectors (positions times the kv head's query heads,
// position-major; a kv head of more than kQueries query heads has them cut over several tasks), transposed once (D x queries, fp32, scaled). It walks its visible columns in blocks of kBlock
// (bf16 keys and values widened to fp32 per block; fp32 ones read where they lie): the block's scores as columns x
// queries (each key entry broadcast over 32 queries' lanes: no transposed keys), then the online softmax across the
// queries' lanes (running max and sum, vectorised exp; each query's visible columns as a lane mask) and the weighted
// sum of values into fp32 accumulators; the outputs divided by the sums and rounded to the entries' type once.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "numerics.h"
#include "paged.h"

namespace {  // internal linkage: inlined freely (a shared library's exported functions are not)
namespace hybridkv_paged_spans {

using namespace hybridkv_cpu;

constexpr int64_t kBlock = 32;     // key columns a block
constexpr int64_t kQueries = 128;  // query vectors a task at most (a multiple of 32: the score tiles' lanes)

// One thread's scratch, reused over its tasks.
struct Scratch {
  std::vector<float> qt;                   // D x kQueries: the task's queries transposed and scaled, zeros past them
  std::vector<float> acc;                  // kQueries x D: the weighted sums
  std::vector<float> top, sum;             // kQueries: running max and sum of exps
  std::vector<int32_t> first, last;        // kQueries: each query vector's visible columns [first, last]
  std::vector<float> keys, values, zeros;  // kBlock x D: a block's bf16 entries widened; a zero entry for the tail
  std::vector<float> scores;               // kBlock x kQueries
  explicit Scratch(int64_t d)
      : qt(d * kQueries), acc(kQueries * d), top(kQueries), sum(kQueries), first(kQueries), last(kQueries),
        keys(kBlock * d), values(kBlock * d), zeros(d), scores(kBlock * kQueries) {}
};

// scores[c][q0 + q] = keys[c] . qt[:, q0 + q] for the block's kBlock columns and 32 query lanes from q0
HYBRIDKV_INLINE void tile_scores(const float* const* keys, const float* qt, int64_t d, int64_t q0, float* scores) {
#if defined(__AVX512F__)
  for (int64_t c0 = 0; c0 < kBlock; c0 += 8) {  // 8 columns x 32 queries in 16 registers over D
    __m512 s[8][2];
    for (int64_t c = 0; c < 8; ++c) s[c][0] = s[c][1] = _mm512_setzero_ps();
    for (int64_t x = 0; x < d; ++x) {
      const __m512 q0v = _mm512_loadu_ps(qt + x * kQueries + q0), q1v = _mm512_loadu_ps(qt + x * kQueries + q0 + 16);
      for (int64_t c = 0; c < 8; ++c) {
        const __m512 k = _mm512_set1_ps(keys[c0 + c][x]);
        s[c][0] = _mm512_fmadd_ps(k, q0v, s[c][0]);
        s[c][1] = _mm512_fmadd_ps(k, q1v, s[c][1]);
      }
    }
    for (int64_t c = 0; c < 8; ++c) {
      _mm512_storeu_ps(scores + (c0 + c) * kQueries + q0, s[c][0]);
      _mm512_storeu_ps(scores + (c0 + c) * kQueries + q0 + 16, s[c][1]);
    }
  }
#else
  for (int64_t c = 0; c < kBlock; ++c) {
    float* row = scores + c * kQueries + q0;
    for (int64_t q = 0; q < 32; ++q) row[q] = 0.0f;
    for (int64_t x = 0; x < d; ++x) {
      const float k = keys[c][x];
#pragma omp simd
      for (int64_t q = 0; q < 32; ++q) row[q] += k * qt[x * kQueries + q0 + q];
    }
  }
#endif
}

// acc[q] += sum_c weights[c][q] * values[c] for the query vectors [q0, q1) (weights: kBlock rows of kQueries)
HYBRIDKV_INLINE void tile_values(const float* weights, const float* const* values, int64_t d, int64_t q0,
                                 int64_t q1, float* acc) {
  int64_t x0 = 0;
#if defined(__AVX512F__)
  for (; x0 + 64 <= d; x0 += 64) {  // 4 query vectors x 64 outputs in 16 registers over the block's columns
    for (int64_t t0 = q0; t0 < q1; t0 += 4) {
      const int64_t rows = std::min<int64_t>(4, q1 - t0);
      __m512 a[4][4];
      for (int64_t t = 0; t < 4; ++t)
        for (int64_t j = 0; j < 4; ++j)
          a[t][j] = t < rows ? _mm512_loadu_ps(acc + (t0 + t) * d + x0 + 16 * j) : _mm512_setzero_ps();
      for (int64_t c = 0; c < kBlock; ++c) {
        const float* v = values[c] + x0;
        const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), v2 = _mm512_loadu_ps(v + 32),
                     v3 = _mm512_loadu_ps(v + 48);
        const float* w = weights + c * kQueries + t0;  // lanes past q1 are in the row (kQueries wide), unused
        for (int64_t t = 0; t < 4; ++t) {
          const __m512 wt = _mm512_set1_ps(w[t]);
          a[t][0] = _mm512_fmadd_ps(wt, v0, a[t][0]);
          a[t][1] = _mm512_fmadd_ps(wt, v1, a[t][1]);
          a[t][2] = _mm512_fmadd_ps(wt, v2, a[t][2]);
          a[t][3] = _mm512_fmadd_ps(wt, v3, a[t][3]);
        }
      }
      for (int64_t t = 0; t < rows; ++t)
        for (int64_t j = 0; j < 4; ++j) _mm512_storeu_ps(acc + (t0 + t) * d + x0 + 16 * j, a[t][j]);
    }
  }
#endif
  for (int64_t t = q0; t < q1; ++t) {  // the outputs past the last 64 (all of them without AVX-512)
    float* a = acc + t * d;
    for (int64_t c = 0; c < kBlock; ++c) {
      const float w = weights[c * kQueries + t];
      const float* v = values[c];
#pragma omp simd
      for (int64_t x = x0; x < d; ++x) a[x] += w * v[x];
    }
  }
}

// One block's online softmax over the query lanes [l_lo, l_hi) (multiples of 16) of scores (kBlock rows of
// kQueries): a score becomes its weight exp(score - max), 0 where the query does not see the column (outside
// [first, last], or past the block's `cols`); top and sum (each lane's running max and sum of weights) move on;
// rescale gets each lane's factor for its earlier sums (0 before its first visible column).
HYBRIDKV_INLINE void block_softmax(float* scores, const int32_t* first, const int32_t* last, int64_t c0, int64_t cols,
                                   int64_t l_lo, int64_t l_hi, float* top, float* sum, float* rescale) {
#if defined(__AVX512F__)
  const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t t = l_lo; t < l_hi; t += 16) {
    const __m512i f = _mm512_loadu_si512(first + t), l = _mm512_loadu_si512(last + t);
    __m512 block_top = minus_inf;
    __mmask16 seen[kBlock];
    for (int64_t c = 0; c < cols; ++c) {
      const __m512i col = _mm512_set1_epi32(static_cast<int32_t>(c0 + c));
      seen[c] = _mm512_cmple_epi32_mask(f, col) & _mm512_cmple_epi32_mask(col, l);
      block_top = _mm512_max_ps(block_top, _mm512_mask_mov_ps(minus_inf, seen[c], _mm512_loadu_ps(scores + c * kQueries + t)));
    }
    const __m512 old_top = _mm512_loadu_ps(top + t), next = _mm512_max_ps(old_top, block_top);
    const __mmask16 started = _mm512_cmp_ps_mask(old_top, minus_inf, _CMP_NEQ_OQ);
    _mm512_storeu_ps(rescale + t, _mm512_maskz_mov_ps(started, exp_approx16(_mm512_sub_ps(old_top, next))));
    _mm512_storeu_ps(top + t, next);
    __m512 total = _mm512_setzero_ps();
    for (int64_t c = 0; c < kBlock; ++c) {
      float* row = scores + c * kQueries + t;
      if (c >= cols) {
        _mm512_storeu_ps(row, _mm512_setzero_ps());
        continue;
      }
      const __m512 w = _mm512_maskz_mov_ps(seen[c], exp_approx16(_mm512_sub_ps(_mm512_loadu_ps(row), next)));
      _mm512_storeu_ps(row, w);
      total = _mm512_add_ps(total, w);
    }
    _mm512_storeu_ps(sum + t, _mm512_fmadd_ps(_mm512_loadu_ps(sum + t), _mm512_loadu_ps(rescale + t), total));
  }
#else
  for (int64_t t = l_lo; t < l_hi; ++t) {
    float block_top = -INFINITY;
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t col = c0 + c;
      float& x = scores[c * kQueries + t];
      x = first[t] <= col && col <= last[t] ? x : -INFINITY;
      block_top = std::max(block_top, x);
    }
    const float next = std::max(top[t], block_top);
    rescale[t] = top[t] == -INFINITY ? 0.0f : exp_approx(top[t] - next);
    top[t] = next;
    float total = 0.0f;
    for (int64_t c = 0; c < kBlock; ++c) {
      float& x = scores[c * kQueries + t];
      x = c >= cols || x == -INFINITY ? 0.0f : exp_approx(x - next);
      total += x;
    }
    sum[t] = sum[t] * rescale[t] + total;
  }
#endif
}

// T: the entries' storage, uint16_t (bf16 bits) or float
template <typename T>
void attend(const at::Tensor& q, const at::Tensor& grid, int64_t k_slot, int64_t v_slot, const at::Tensor& table,
            const at::Tensor& start, const at::Tensor& stop, const at::Tensor& q_begin, int64_t window, double scale,
            at::Tensor& out) {
  const int64_t rows = start.size(0), heads = q.size(1), d = q.size(2), kv_heads = grid.size(3);
  const int64_t group = heads / kv_heads;
  const int64_t sub = std::min(group, kQueries);           // a kv head's query heads a task takes, at most
  const int64_t head_parts = (group + sub - 1) / sub;      // tasks a kv head's heads are cut into (1 unless > kQueries)
  const int64_t positions = std::max<int64_t>(1, kQueries / sub);  // query positions a task
  const PagedEntries<T> entries(grid, table, k_slot, v_slot);
  const auto* qs = reinterpret_cast<const T*>(q.data_ptr());
  auto* os = reinterpret_cast<T*>(out.data_ptr());
  const int64_t* lo = start.data_ptr<int64_t>();
  const int64_t* hi = stop.data_ptr<int64_t>();
  const int64_t* begin_of = q_begin.data_ptr<int64_t>();
  std::vector<int64_t> task_row, task_first;  // tasks: (row, first query position), times kv heads and head parts
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < begin_of[r + 1] - begin_of[r]; i += positions) {
      task_row.push_back(r);
      task_first.push_back(i);
    }
  const int64_t chunks = static_cast<int64_t>(task_row.size());
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, chunks * kv_heads * head_parts, 1, [&](int64_t begin, int64_t end) {
    Scratch s(d);
    const float* keys[kBlock];
    const float* values[kBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t chunk = task / (kv_heads * head_parts), h = task / head_parts % kv_heads, r = task_row[chunk];
      const int64_t h0 = h * group + task % head_parts * sub;  // the task's first query head
      const int64_t hs = std::min(sub, (h + 1) * group - h0);  // and how many it takes
      const int64_t n = begin_of[r + 1] - begin_of[r], i0 = task_first[chunk], i1 = std::min(n, i0 + positions);
      const int64_t m = (i1 - i0) * hs, lanes = (m + 31) / 32 * 32, col0 = hi[r] - n;
      const T* from[kQueries];  // query vector t: position i0 + t / hs, head h0 + t % hs
      for (int64_t t = 0; t < lanes; ++t) {
        const int64_t i = i0 + t / hs;
        from[t] = t < m ? qs + ((begin_of[r] + i) * heads + h0 + t % hs) * d : nullptr;
        s.first[t] = static_cast<int32_t>(t >= m ? 1 : window > 0 ? std::max(lo[r], col0 + i + 1 - window) : lo[r]);
        s.last[t] = static_cast<int32_t>(t >= m ? 0 : col0 + i);  // a padding lane sees nothing
        s.top[t] = -INFINITY;
        s.sum[t] = 0.0f;
      }
      for (int64_t x0 = 0; x0 < d; x0 += 16) {  // transposed 16 entries of D at a time: 16 rows of qt in cache
        const int64_t x1 = std::min(d, x0 + 16);
        for (int64_t t = 0; t < lanes; ++t) {
          float* to = s.qt.data() + t;
          for (int64_t x = x0; x < x1; ++x) to[x * kQueries] = t < m ? load(from[t][x]) * fscale : 0.0f;
        }
      }
      std::fill(s.acc.begin(), s.acc.begin() + m * d, 0.0f);
      const int64_t c_end = col0 + i1;  // one past the last query's column
      for (int64_t c0 = s.first[0]; c0 < c_end; c0 += kBlock) {
        const int64_t cols = std::min(kBlock, c_end - c0);
        for (int64_t c = 0; c < kBlock; ++c) {  // the block's entries as fp32 rows; a zero entry past its end
          if (c >= cols) {
            keys[c] = values[c] = s.zeros.data();
            continue;
          }
          if constexpr (std::is_same_v<T, float>) {
            keys[c] = entries.key(r, c0 + c, h);
            values[c] = entries.value(r, c0 + c, h);
          } else {
            float* key = s.keys.data() + c * d;
            float* value = s.values.data() + c * d;
            const T* k = entries.key(r, c0 + c, h);
            const T* v = entries.value(r, c0 + c, h);
#pragma omp simd
            for (int64_t x = 0; x < d; ++x) {
              key[x] = load(k[x]);
              value[x] = load(v[x]);
            }
            keys[c] = key;
            values[c] = value;
          }
        }
        // the query vectors that see some column of the block (visible ranges rise with the position)
        int64_t q_lo = 0, q_hi = m;
        while (q_lo < m && s.last[q_lo] < c0) ++q_lo;
        while (q_hi > q_lo && s.first[q_hi - 1] >= c0 + cols) --q_hi;
        if (q_lo == q_hi) continue;
        const int64_t l_lo = q_lo / 32 * 32, l_hi = (q_hi + 31) / 32 * 32;
        for (int64_t q0 = l_lo; q0 < l_hi; q0 += 32) tile_scores(keys, s.qt.data(), d, q0, s.scores.data());
        float* sc = s.scores.data();
        float rescale[kQueries];
        block_softmax(sc, s.first.data(), s.last.data(), c0, cols, l_lo, l_hi, s.top.data(), s.sum.data(), rescale);
        for (int64_t t = l_lo; t < std::min(l_hi, m); ++t) {
          if (rescale[t] != 1.0f) {
            float* a = s.acc.data() + t * d;
#pragma omp simd
            for (int64_t x = 0; x < d; ++x) a[x] *= rescale[t];
          }
        }
        tile_values(sc, values, d, l_lo, std::min(l_hi, m), s.acc.data());
      }
      for (int64_t t = 0; t < m; ++t) {
        const float* a = s.acc.data() + t * d;
        const float total = s.sum[t];
        T* o = os + ((begin_of[r] + i0 + t / hs) * heads + h0 + t % hs) * d;
#pragma omp simd
        for (int64_t x = 0; x < d; ++x) store(o + x, a[x] / total);
      }
    }
  });
}

at::Tensor paged_spans(const at::Tensor& q, const at::Tensor& grid, int64_t k_slot, int64_t v_slot,
                       const at::Tensor& table, const at::Tensor& start, const at::Tensor& stop,
                       const at::Tensor& q_begin, int64_t window, double scale) {
  check_paged("paged_spans", q, grid, k_slot, v_slot, table, start, stop);
  TORCH_CHECK(q_begin.scalar_type() == at::kLong && q_begin.is_contiguous() && q_begin.dim() == 1 &&
                  q_begin.size(0) == start.size(0) + 1 && window >= 0,
              "paged_spans: int64 q_begin (rows + 1,) and a window >= 0");
  const int64_t rows = start.size(0), tokens = q.size(0), width = table.size(1), page = grid.size(2);
  const int64_t* lo = start.data_ptr<int64_t>();
  const int64_t* hi = stop.data_ptr<int64_t>();
  const int64_t* first = q_begin.data_ptr<int64_t>();
  TORCH_CHECK(first[0] == 0 && first[rows] == tokens, "paged_spans: q_begin must run from 0 to the ", tokens,
              " query tokens, got ", first[0], " .. ", first[rows]);
  for (int64_t r = 0; r < rows; ++r) {  // bounds checked here, before any read
    const int64_t n = first[r + 1] - first[r];
    TORCH_CHECK(n >= 1 && 0 <= lo[r] && lo[r] <= hi[r] - n && hi[r] <= width * page, "paged_spans: row ", r, "'s ",
                n, " queries over columns [", lo[r], ", ", hi[r], ") out of range");
  }
  check_cells("paged_spans", grid, table, start, stop);
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat)
    attend<float>(q, grid, k_slot, v_slot, table, start, stop, q_begin, window, scale, out);
  else
    attend<uint16_t>(q, grid, k_slot, v_slot, table, start, stop, q_begin, window, scale, out);
  return out;
}

}  // namespace hybridkv_paged_spans
}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridkv, m) {
  m.def("paged_spans(Tensor q, Tensor grid, int k_slot, int v_slot, Tensor table, Tensor start, Tensor stop, Tensor q_begin, int window, float scale) -> Tensor", &hybridkv_paged_spans::paged_spans);
}
