// x @ w.T for a few rows of x, streaming w once (skinny_linear.cpp, moe_decode.cpp): block_rows<L, M> computes
// out[m, n0:n1] for M rows of x, each output a dot product of an x row and a weight row summed in fp32 (bf16 products
// exact in fp32, VDPBF16PS where the CPU has it), plus the bias in fp32, rounded once to the dtype. The weight is
// streamed ROWS rows at a time (each x row against ROWS weight rows, ROWS x M accumulators in registers), the rows
// AHEAD rows on prefetched: the hardware prefetcher alone leaves the stream ~25% short of oneDNN's on the 32k-row
// logits. L is F32 or BF16 (the entry type and its lanes). gemv_rows runs it on 1 to GEMV_MAX_X rows of x, the
// weight's rows split among the threads.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "numerics.h"

namespace hybridkv_cpu {

constexpr int GEMV_ROWS = 4;   // weight rows per block
constexpr int GEMV_AHEAD = 8;  // weight rows prefetched ahead of the block
constexpr int GEMV_MAX_X = 4;  // rows of x a call takes, at most
constexpr int64_t GEMV_GRAIN = 16;  // weight blocks per thread's share, at least

#if defined(__AVX512F__)
// One lane group of 16 fp32 products summed into acc: x and w at `k`, `valid` of the group's entries (16 for fp32,
// 32 for bf16 pairs) loaded, the rest zero.
struct F32 {
  using T = float;
  static constexpr int64_t STEP = 16;
  static HYBRIDKV_INLINE __m512 load(const float* p, __mmask32 valid) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>(valid), p);
  }
  static HYBRIDKV_INLINE __m512 fma(__m512 acc, __m512 x, __m512 w) { return _mm512_fmadd_ps(x, w, acc); }
};

struct BF16 {
  using T = uint16_t;
#if defined(__AVX512BF16__)
  static constexpr int64_t STEP = 32;
  static HYBRIDKV_INLINE __m512i load(const uint16_t* p, __mmask32 valid) { return _mm512_maskz_loadu_epi16(valid, p); }
  static HYBRIDKV_INLINE __m512 fma(__m512 acc, __m512i x, __m512i w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
  }
#else  // AVX-512 without BF16: widen 16 entries to fp32 (bf16 is fp32's upper half) and fma
  static constexpr int64_t STEP = 16;
  static HYBRIDKV_INLINE __m512 load(const uint16_t* p, __mmask32 valid) {
    const __m256i half = _mm256_maskz_loadu_epi16(static_cast<__mmask16>(valid), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  }
  static HYBRIDKV_INLINE __m512 fma(__m512 acc, __m512 x, __m512 w) { return _mm512_fmadd_ps(x, w, acc); }
#endif
};

// out[m, n0:n1] for M rows of x
template <class L, int M>
void block_rows(const typename L::T* x, const typename L::T* w, int64_t ws, const typename L::T* bias,
                typename L::T* out, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  using T = typename L::T;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (K % L::STEP)) - 1);
  const int64_t full = K - K % L::STEP;
  for (int64_t n = n0; n < n1; n += GEMV_ROWS) {
    const int count = static_cast<int>(std::min<int64_t>(GEMV_ROWS, n1 - n));
    const T* row[GEMV_ROWS];
#pragma GCC unroll 8
    for (int j = 0; j < GEMV_ROWS; ++j) row[j] = w + (n + std::min(j, count - 1)) * ws;  // past the end: the last again
    __m512 acc[M][GEMV_ROWS];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
      for (int j = 0; j < GEMV_ROWS; ++j) acc[m][j] = _mm512_setzero_ps();
    auto step = [&](int64_t k, __mmask32 valid) __attribute__((always_inline)) {
      decltype(L::load(x, valid)) xv[M];
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) xv[m] = L::load(x + m * K + k, valid);
#pragma GCC unroll 8
      for (int j = 0; j < GEMV_ROWS; ++j) {
        const auto wv = L::load(row[j] + k, valid);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) acc[m][j] = L::fma(acc[m][j], xv[m], wv);
      }
    };
    for (int64_t k = 0; k < full; k += L::STEP) {
#pragma GCC unroll 8
      for (int j = 0; j < GEMV_ROWS; ++j)  // a prefetch past the weight's end is dropped, not a fault
        _mm_prefetch(reinterpret_cast<const char*>(row[j] + GEMV_AHEAD * ws + k), _MM_HINT_T0);
      step(k, static_cast<__mmask32>(~0u));
    }
    if (full < K) step(full, tail);
    float sums[M][GEMV_ROWS];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
      for (int j = 0; j < GEMV_ROWS; ++j) sums[m][j] = _mm512_reduce_add_ps(acc[m][j]);
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < count; ++j) store(out + m * N + n + j, sums[m][j] + (bias ? load(bias[n + j]) : 0.0f));
  }
}
#else  // portable: one dot product per output, vectorised by the compiler
struct F32 {
  using T = float;
};
struct BF16 {
  using T = uint16_t;
};

template <class L, int M>
void block_rows(const typename L::T* x, const typename L::T* w, int64_t ws, const typename L::T* bias,
                typename L::T* out, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int m = 0; m < M; ++m) {
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t k = 0; k < K; ++k) dot += load(x[m * K + k]) * load(w[n * ws + k]);
      store(out + m * N + n, dot + (bias ? load(bias[n]) : 0.0f));
    }
}
#endif

// out (M, N) = x (M, K) times the N rows of w (row stride ws) (+ bias (N,) or nullptr), M in 1..GEMV_MAX_X
template <class L>
void gemv_rows(const typename L::T* x, int64_t M, const typename L::T* w, int64_t ws, const typename L::T* bias,
               typename L::T* out, int64_t K, int64_t N) {
  at::parallel_for(0, (N + GEMV_ROWS - 1) / GEMV_ROWS, GEMV_GRAIN, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * GEMV_ROWS, n1 = std::min(N, end * GEMV_ROWS);
    switch (M) {
      case 1: block_rows<L, 1>(x, w, ws, bias, out, K, N, n0, n1); break;
      case 2: block_rows<L, 2>(x, w, ws, bias, out, K, N, n0, n1); break;
      case 3: block_rows<L, 3>(x, w, ws, bias, out, K, N, n0, n1); break;
      default: block_rows<L, 4>(x, w, ws, bias, out, K, N, n0, n1); break;
    }
  });
}

}  // namespace hybridkv_cpu
