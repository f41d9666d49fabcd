// x @ w.T for a few rows of x, streaming w once (skinny_linear.cpp, moe_decode.cpp): block_rows<L, M, R> computes
// out[m, n0:n1] for M rows of x, each output a dot product of an x row and a weight row summed in fp32 (bf16 products
// exact in fp32, VDPBF16PS where the CPU has it), plus the bias in fp32, rounded once to the dtype. The weight is
// streamed R rows at a time (each x row against R weight rows, R x M accumulators in registers), the rows AHEAD rows
// on prefetched: the hardware prefetcher alone leaves the stream ~25% short of oneDNN's on the 32k-row logits. L is
// F32 or BF16 (the entry type and its lanes). gemv_rows runs it on 1 to GEMV_MAX_X rows of x, the weight's rows split
// among the threads.
//
// R (block_of): GEMV_ROWS, but for one row of x L::SOLO_ROWS: with one x row the registers hold more accumulators,
// and more weight rows streamed at once keep more of the memory's bandwidth busy. One thread, an AMD EPYC (Zen 5),
// weights cycled out of cache, one row, R = 4 -> SOLO_ROWS: fp32 512 -> 32000 (logits) 1.98 -> 1.47 ms, 512 -> 1024
// 53 -> 41-46 µs, 1024 -> 512 60 -> 44-47 µs; bf16 (16 rows) 512 -> 32000 0.70 -> 0.52 ms, 512 -> 256 6.8 -> 5.6 µs.
// fp32 at 16 rows lost (2.6 ms on the logits); two or four x rows at 8 rows gained nothing or lost (4 x 512 -> 1024
// 53 -> 57 µs: 32 accumulators spill).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "numerics.h"

namespace hybridkv_cpu {

constexpr int GEMV_ROWS = 4;   // weight rows per block (block_of)
constexpr int GEMV_AHEAD = 8;  // weight rows prefetched ahead of the block (at least the block's own rows)
constexpr int GEMV_MAX_X = 4;  // rows of x a call takes, at most
constexpr int64_t GEMV_GRAIN = 16;  // weight blocks per thread's share, at least

#if defined(__AVX512F__)
// One lane group of 16 fp32 products summed into acc: x and w at `k`, `valid` of the group's entries (16 for fp32,
// 32 for bf16 pairs) loaded, the rest zero.
struct F32 {
  using T = float;
  static constexpr int SOLO_ROWS = 8;
  static constexpr int64_t STEP = 16;
  static HYBRIDKV_INLINE __m512 load(const float* p, __mmask32 valid) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>(valid), p);
  }
  static HYBRIDKV_INLINE __m512 fma(__m512 acc, __m512 x, __m512 w) { return _mm512_fmadd_ps(x, w, acc); }
};

struct BF16 {
  using T = uint16_t;
  static constexpr int SOLO_ROWS = 16;
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

// out[m, n0:n1] for M rows of x, R weight rows a block
template <class L, int M, int R>
void block_rows(const typename L::T* x, const typename L::T* w, int64_t ws, const typename L::T* bias,
                typename L::T* out, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  using T = typename L::T;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (K % L::STEP)) - 1);
  const int64_t full = K - K % L::STEP;
  constexpr int64_t ahead = R > GEMV_AHEAD ? R : GEMV_AHEAD;  // at least the next block
  for (int64_t n = n0; n < n1; n += R) {
    const int count = static_cast<int>(std::min<int64_t>(R, n1 - n));
    const T* row[R];
#pragma GCC unroll 16
    for (int j = 0; j < R; ++j) row[j] = w + (n + std::min(j, count - 1)) * ws;  // past the end: the last again
    __m512 acc[M][R];
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
      for (int j = 0; j < R; ++j) acc[m][j] = _mm512_setzero_ps();
    auto step = [&](int64_t k, __mmask32 valid) __attribute__((always_inline)) {
      decltype(L::load(x, valid)) xv[M];
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) xv[m] = L::load(x + m * K + k, valid);
#pragma GCC unroll 16
      for (int j = 0; j < R; ++j) {
        const auto wv = L::load(row[j] + k, valid);
#pragma GCC unroll 16
        for (int m = 0; m < M; ++m) acc[m][j] = L::fma(acc[m][j], xv[m], wv);
      }
    };
    for (int64_t k = 0; k < full; k += L::STEP) {
#pragma GCC unroll 16
      for (int j = 0; j < R; ++j)  // a prefetch past the weight's end is dropped, not a fault
        _mm_prefetch(reinterpret_cast<const char*>(row[j] + ahead * ws + k), _MM_HINT_T0);
      step(k, static_cast<__mmask32>(~0u));
    }
    if (full < K) step(full, tail);
    float sums[M][R];
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
      for (int j = 0; j < R; ++j) sums[m][j] = _mm512_reduce_add_ps(acc[m][j]);
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < count; ++j) store(out + m * N + n + j, sums[m][j] + (bias ? load(bias[n + j]) : 0.0f));
  }
}
#else  // portable: one dot product per output, vectorised by the compiler
struct F32 {
  using T = float;
  static constexpr int SOLO_ROWS = 1;
};
struct BF16 {
  using T = uint16_t;
  static constexpr int SOLO_ROWS = 1;
};

template <class L, int M, int R>
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

// The weight rows a block of block_rows<L, M, ...> streams at once.
template <class L, int M>
constexpr int block_of() {
  return M == 1 ? L::SOLO_ROWS : GEMV_ROWS;
}

// out (M, N) = x (M, K) times the N rows of w, the blocks split among the threads
template <class L, int M>
void gemv_split(const typename L::T* x, const typename L::T* w, int64_t ws, const typename L::T* bias,
                typename L::T* out, int64_t K, int64_t N) {
  constexpr int R = block_of<L, M>();
  at::parallel_for(0, (N + R - 1) / R, GEMV_GRAIN, [&](int64_t begin, int64_t end) {
    block_rows<L, M, R>(x, w, ws, bias, out, K, N, begin * R, std::min(N, end * R));
  });
}

// out (M, N) = x (M, K) times the N rows of w (row stride ws) (+ bias (N,) or nullptr), M in 1..GEMV_MAX_X
template <class L>
void gemv_rows(const typename L::T* x, int64_t M, const typename L::T* w, int64_t ws, const typename L::T* bias,
               typename L::T* out, int64_t K, int64_t N) {
  switch (M) {
    case 1: gemv_split<L, 1>(x, w, ws, bias, out, K, N); break;
    case 2: gemv_split<L, 2>(x, w, ws, bias, out, K, N); break;
    case 3: gemv_split<L, 3>(x, w, ws, bias, out, K, N); break;
    default: gemv_split<L, 4>(x, w, ws, bias, out, K, N); break;
  }
}

}  // namespace hybridkv_cpu
