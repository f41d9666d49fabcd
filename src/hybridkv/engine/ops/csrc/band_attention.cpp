// Attention of padded query rows over a key part whose mask leaves each query a narrow band of columns (a sliding
// window layer's prefill: hybridkv.engine.ops.band_attention, which says when the engine takes it). Dense attention
// (scaled_dot_product_attention) computes every (query, column) pair and masks most away; this reads only the
// columns between each query's first and last visible one.
//
// q (R, H, Q, D), k and v (R, W, KV, D) bf16 (any strides, D contiguous), mask (R, 1, Q, W) fp32 additive (0 or
// -inf; finite values are added as logits). Query head h reads kv head h / (H / KV). Per (row, query): the columns
// [lo, hi) from its first to its last finite mask entry, scores q . k (bf16 products summed in fp32: VDPBF16PS pairs
// where the CPU has AVX512-BF16) times scale plus the mask, softmax in fp32 (a vectorised exp, ~1 ulp), the weighted
// sum of values in fp32, rounded to bf16 once. A query that sees no column gets zeros (only padded queries can, and
// their outputs are dropped). The output is (R, H, Q, D), laid out as (R, Q, H, D).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "numerics.h"

namespace {  // internal linkage: inlined freely (a shared library's exported functions are not)
namespace hybridkv_band_attention {

using namespace hybridkv_cpu;

at::Tensor band_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                          double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 4,
              "band_attention: q (R, H, Q, D), k and v (R, W, KV, D), mask (R, 1, Q, W)");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16 && mask.scalar_type() == at::kFloat,
              "band_attention: bf16 q, k, v and an fp32 mask, got ", q.scalar_type(), " ", k.scalar_type(), " ",
              v.scalar_type(), " ", mask.scalar_type());
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && mask.stride(3) == 1,
              "band_attention: the last dim of q, k, v and mask must be contiguous");
  const int64_t rows = q.size(0), heads = q.size(1), queries = q.size(2), d = q.size(3);
  const int64_t width = k.size(1), kv_heads = k.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == rows && k.size(3) == d && kv_heads > 0 &&
                  heads % kv_heads == 0 && mask.size(0) == rows && mask.size(1) == 1 && mask.size(2) == queries &&
                  mask.size(3) == width,
              "band_attention: shapes disagree: q ", q.sizes(), " k ", k.sizes(), " v ", v.sizes(), " mask ",
              mask.sizes());
  const int64_t group = heads / kv_heads;
  auto out = at::empty({rows, queries, heads, d}, q.options());
  const auto* qs = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* ks = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vs = reinterpret_cast<const uint16_t*>(v.data_ptr());
  const float* ms = mask.data_ptr<float>();
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr());
  // strides as locals: read once, and known not to change under the loops' stores (kept in registers)
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1), q_s2 = q.stride(2);
  const int64_t k_s0 = k.stride(0), k_s1 = k.stride(1), k_s2 = k.stride(2);
  const int64_t v_s0 = v.stride(0), v_s1 = v.stride(1), v_s2 = v.stride(2);
  const int64_t m_s0 = mask.stride(0), m_s2 = mask.stride(2);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(group * d), scores;
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < queries; ++i) {
        const float* m = ms + r * m_s0 + i * m_s2;
        int64_t lo = width, hi = 0;  // the first and one past the last visible column, in one vector pass
#pragma omp simd reduction(min : lo) reduction(max : hi)
        for (int64_t c = 0; c < width; ++c) {
          const bool seen = m[c] != -INFINITY;
          lo = seen && c < lo ? c : lo;
          hi = seen && c + 1 > hi ? c + 1 : hi;
        }
        const int64_t n = hi > lo ? hi - lo : 0;
        scores.resize(group * n);
        for (int64_t h = 0; h < kv_heads; ++h) {
          const uint16_t* kr = ks + r * k_s0 + h * k_s2;
          const uint16_t* vr = vs + r * v_s0 + h * v_s2;
          const uint16_t* qh = qs + r * q_s0 + h * group * q_s1 + i * q_s2;
          for (int64_t c = 0; c < n; ++c) {
            const uint16_t* key = kr + (lo + c) * k_s1;
            for (int64_t j = 0; j < group; ++j)
              scores[j * n + c] = dot_bf16(qh + j * q_s1, key, d) * static_cast<float>(scale) + m[lo + c];
          }
          for (int64_t j = 0; j < group; ++j) {
            float* s = scores.data() + j * n;
            // plain max and sum: a band is a few columns, where a `omp simd` reduction's serial 16-lane epilogue costs
            // more than the loop
            float top = -INFINITY;
            for (int64_t c = 0; c < n; ++c) top = s[c] > top ? s[c] : top;
#pragma omp simd
            for (int64_t c = 0; c < n; ++c) s[c] = exp_approx(s[c] - top);
            float sum = 0.0f;
            for (int64_t c = 0; c < n; ++c) sum += s[c];
            const float inv = 1.0f / sum;
#pragma omp simd
            for (int64_t c = 0; c < n; ++c) s[c] *= inv;
          }
          for (int64_t j = 0; j < group; ++j) {
            const float* w = scores.data() + j * n;
            int64_t x0 = 0;
#if defined(__AVX512F__)
            for (; x0 + 32 <= d; x0 += 32) {  // 32 outputs summed in two registers over the band's columns
              __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
              for (int64_t c = 0; c < n; ++c) {
                const uint16_t* value = vr + (lo + c) * v_s1 + x0;
                const __m512 weight = _mm512_set1_ps(w[c]);
                const __m512i lo16 = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(value)));
                const __m512i hi16 =
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(value + 16)));
                a0 = _mm512_fmadd_ps(weight, _mm512_castsi512_ps(_mm512_slli_epi32(lo16, 16)), a0);
                a1 = _mm512_fmadd_ps(weight, _mm512_castsi512_ps(_mm512_slli_epi32(hi16, 16)), a1);
              }
              _mm512_storeu_ps(acc.data() + j * d + x0, a0);
              _mm512_storeu_ps(acc.data() + j * d + x0 + 16, a1);
            }
#endif
            for (; x0 < d; ++x0) {
              float a = 0.0f;
              for (int64_t c = 0; c < n; ++c) a += w[c] * bf16_to_float(vr[(lo + c) * v_s1 + x0]);
              acc[j * d + x0] = a;
            }
          }
          uint16_t* o = os + ((r * queries + i) * heads + h * group) * d;  // this kv head's group of query heads
#pragma omp simd
          for (int64_t x = 0; x < group * d; ++x) o[x] = float_to_bf16(acc[x]);
        }
      }
    }
  });
  return out.transpose(1, 2);
}

}  // namespace hybridkv_band_attention
}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridkv, m) {
  m.def("band_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor",
        &hybridkv_band_attention::band_attention);
}
