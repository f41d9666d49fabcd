// The chunked gated delta rule (GatedDeltaNet prefill) of bf16 inputs, each chunk's products as bf16 matrix products
// with fp32 sums through ATen's brgemm (AMX tiles where the CPU has them), or, where ATen's brgemm cannot run bf16
// (a CPU without AMX), through dpbf16_product: AVX-512 BF16's VDPBF16PS on the same operands
// (hybridkv.engine.ops.delta_chunks).
//
// Row b, value head h (key head h / (HV / HK)), its first lengths[b] positions, in chunks of C from the call's first
// token; the state S (dk, dv) fp32 carried from state[b, h]. Per chunk of n tokens, with k, q L2-normalised in fp32
// (q scaled by dk^-0.5), kb = k * beta, vb = v * beta, c the chunk's running sum of the log decays g and
// e(x) = exp(x) (0 below -flush):
//   P = kb k^T, Q = q k^T                          (n x n; one product of the stacked [kb; q])
//   L = strictly lower P * e(c_i - c_j);  T = (I + L)^-1   (forward substitution, fp32)
//   [U | W] = T [vb | kb * e(c)]                   (one product)
//   V' = U - W S;  o = (q * e(c)) S + (lower Q * e(c_i - c_j)) V'
//   S = S * e(c_last) + (k * e(c_last - c))^T V'
// the arithmetic of ops.gated_delta's torch path (transformers' torch_chunk_gated_delta_rule), except that every
// product's operands are rounded to bf16 (the normalised keys and queries, T, W, S, V'), as FLA's kernels round them
// on a GPU: within bf16's rounding of the fp32 path, not equal to it. Positions past lengths[b] are not read; their
// outputs are zero.
//
// q, k (B, T, HK, dk) and v (B, T, HV, dv) bf16, each row contiguous (any other strides); g, beta (B, T, HV) fp32
// contiguous; state (B, HV, dk, dv) fp32 contiguous; lengths (B) int64, each in [0, T] (all checked first). dk even
// (bf16 pairs of the VNNI layout). Every (row, head) is one task of at::parallel_for.
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "numerics.h"

namespace {
namespace hybridkv_delta_chunks {

using namespace hybridkv_cpu;

void to_bf16(const float* src, int64_t n, uint16_t* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(src[i]);
}

// Two rows as brgemm's bf16 pairs: word j = bf16(a[j]) | bf16(b[j]) << 16 (b null: a zero row)
void pair_rows(const float* a, const float* b, int64_t n, uint32_t* out) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) {
    const __m512i lo = _mm512_cvtepu16_epi32(bf16x16(_mm512_loadu_ps(a + j)));
    const __m512i hi = b == nullptr ? _mm512_setzero_si512()
                                    : _mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16(_mm512_loadu_ps(b + j))), 16);
    _mm512_storeu_si512(out + j, _mm512_or_si512(lo, hi));
  }
#endif
  for (; j < n; ++j) out[j] = float_to_bf16(a[j]) | (b == nullptr ? 0u : uint32_t{float_to_bf16(b[j])} << 16);
}

// brgemm's B (K x N, bf16) as it reads it, "VNNI": entry (r, j) at [r / 2][j][r % 2]. Rows src[r] (n entries,
// ld apart) for r < rows, a zero row after an odd count.
void vnni_rows(const float* src, int64_t ld, int64_t rows, int64_t n, uint16_t* out) {
  auto* words = reinterpret_cast<uint32_t*>(out);
  for (int64_t r = 0; r < rows; r += 2)
    pair_rows(src + r * ld, r + 1 < rows ? src + (r + 1) * ld : nullptr, n, words + (r / 2) * n);
}

// B = src^T in the same layout: src (n rows of k entries, k even), B (k x n); entry (r, j) = src[j][r], so the pair
// (2p, 2p + 1) of column j is row j's entries 2p, 2p + 1: each row rounded at once into row_b (k entries), its words
// copied out (memcpy: row_b is read as words without aliasing it)
void vnni_transposed(const float* src, int64_t n, int64_t k, uint16_t* row_b, uint16_t* out) {
  auto* words = reinterpret_cast<uint32_t*>(out);  // only brgemm reads them back
  for (int64_t j = 0; j < n; ++j) {
    to_bf16(src + j * k, k, row_b);
    for (int64_t p = 0; p < k / 2; ++p) std::memcpy(words + p * n + j, row_b + 2 * p, sizeof(uint32_t));
  }
}

// Whether ATen's brgemm computes bf16 here (oneDNN's ukernels: AMX)
bool brgemm_bf16() {
  static const bool ready = at::native::cpublas::could_pack(at::kBFloat16);
  return ready;
}

#if defined(__AVX512BF16__)
constexpr bool DPBF16 = true;
constexpr int64_t DP_ROWS = 4;    // rows of A a block takes
constexpr int64_t DP_BLOCKS = 4;  // accumulators of 16 columns of C per row of A

// C[i0:i0 + R, j0:j0 + 16 * blocks] of dpbf16_product: R x blocks accumulators; per pair of A's entries, each row's
// pair broadcast once and each 16-lane word of B's pair row loaded once
template <int64_t R>
HYBRIDKV_INLINE void dp_block(int64_t n, int64_t k, const uint16_t* a, const int32_t* pairs_b, float* c, int64_t ldc,
                              bool add, int64_t i0, int64_t j0, int64_t blocks, const __mmask16* mask) {
  __m512 acc[R][DP_BLOCKS];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t w = 0; w < blocks; ++w)
      acc[r][w] = add ? _mm512_maskz_loadu_ps(mask[w], c + (i0 + r) * ldc + j0 + 16 * w) : _mm512_setzero_ps();
  for (int64_t p = 0; p < k / 2; ++p) {
    __m512bh a_pair[R];
    for (int64_t r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + (i0 + r) * k + 2 * p, sizeof(pair));
      a_pair[r] = (__m512bh)_mm512_set1_epi32(pair);
    }
    const int32_t* b_row = pairs_b + p * n + j0;
    for (int64_t w = 0; w < blocks; ++w) {
      const __m512bh b_pair = (__m512bh)_mm512_maskz_loadu_epi32(mask[w], b_row + 16 * w);
      for (int64_t r = 0; r < R; ++r) acc[r][w] = _mm512_dpbf16_ps(acc[r][w], a_pair[r], b_pair);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t w = 0; w < blocks; ++w) _mm512_mask_storeu_ps(c + (i0 + r) * ldc + j0 + 16 * w, mask[w], acc[r][w]);
}

// product's arithmetic without brgemm: blocks of DP_ROWS rows of A by 64 columns of C, one VDPBF16PS per pair of A's
// entries (the pair broadcast, against the pair row of B, which the VNNI layout stores as 16-lane words): products
// exact in fp32, fp32 sums (another order than brgemm's: within fp32 rounding of it). k even.
void dpbf16_product(int64_t m, int64_t n, int64_t k, const uint16_t* a, const uint16_t* b, float* c, int64_t ldc,
                    bool add) {
  const auto* pairs_b = reinterpret_cast<const int32_t*>(b);  // [k / 2][n] words (only read back as words)
  for (int64_t j0 = 0; j0 < n; j0 += 16 * DP_BLOCKS) {
    __mmask16 mask[DP_BLOCKS];
    const int64_t blocks = std::min<int64_t>(DP_BLOCKS, (n - j0 + 15) / 16);
    for (int64_t w = 0; w < blocks; ++w) {
      const int64_t left = n - j0 - 16 * w;
      mask[w] = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    }
    int64_t i0 = 0;
    for (; i0 + DP_ROWS <= m; i0 += DP_ROWS) dp_block<DP_ROWS>(n, k, a, pairs_b, c, ldc, add, i0, j0, blocks, mask);
    for (; i0 < m; ++i0) dp_block<1>(n, k, a, pairs_b, c, ldc, add, i0, j0, blocks, mask);
  }
}
#else
constexpr bool DPBF16 = false;
void dpbf16_product(int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*, float*, int64_t, bool) {
  TORCH_CHECK(false, "delta_chunks: this build has neither bf16 brgemm nor AVX-512 BF16 (delta_chunks_ready)");
}
#endif

// C (m x n, ldc) = A (m x k bf16, row-major) B (k x n bf16, VNNI), or C += when add
void product(int64_t m, int64_t n, int64_t k, const uint16_t* a, const uint16_t* b, float* c, int64_t ldc, bool add) {
  if (!brgemm_bf16()) return dpbf16_product(m, n, k, a, b, c, ldc, add);
  at::native::cpublas::brgemm(m, n, k, k, n, ldc, add, reinterpret_cast<const at::BFloat16*>(a),
                              reinterpret_cast<const at::BFloat16*>(b), c, true);
}

// The thread's brgemm hardware context (AMX tile configuration) released when its tasks end, thrown out of or not.
struct TilesReleased {
  TilesReleased() = default;
  TilesReleased(const TilesReleased&) = delete;
  TilesReleased& operator=(const TilesReleased&) = delete;
  ~TilesReleased() {
    if (brgemm_bf16()) at::native::cpublas::brgemm_release(true);
  }
};

struct Shape {
  int64_t seq, heads_k, heads_v, dk, dv, chunk;
  float flush;
};

// One task's buffers, sized for a whole chunk once.
struct Scratch {
  std::vector<float> k, q, v, cum, beta, decays, pq, inverse, rows, uw, wso, v_new;
  std::vector<uint16_t> stacked, row_b, keys_t, values_keys, lower, states, v_new_b, keys_decayed, keys_decayed_t;
  explicit Scratch(const Shape& s)
      : k(s.chunk * s.dk), q(s.chunk * s.dk), v(s.chunk * s.dv), cum(s.chunk), beta(s.chunk), decays(s.chunk),
        pq(2 * s.chunk * s.chunk), inverse(s.chunk * ((s.chunk + 15) / 16 * 16)), rows(s.chunk * (s.dv + s.dk)),
        uw(s.chunk * (s.dv + s.dk)), wso(2 * s.chunk * s.dv), v_new(s.chunk * s.dv),
        stacked(2 * s.chunk * std::max(s.dk, s.chunk + 1)), row_b(s.dk), keys_t(s.dk * s.chunk),
        values_keys((s.chunk + 1) * (s.dv + s.dk)), lower(s.chunk * (s.chunk + 1)), states(s.dk * s.dv),
        v_new_b((s.chunk + 1) * s.dv), keys_decayed(s.chunk * s.dk), keys_decayed_t(s.dk * (s.chunk + 1)) {}
};

// x (d) bf16 -> out = x / sqrt(sum x^2 + 1e-6) * scale, fp32
void l2norm(const uint16_t* x, int64_t d, float scale, float* out) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < d; ++i) {
    const float xi = bf16_to_float(x[i]);
    sum += xi * xi;
  }
  const float factor = 1.0f / std::sqrt(sum + 1e-6f);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = bf16_to_float(x[i]) * factor * scale;
}

// e(x): exp(x), or 0 below -flush
HYBRIDKV_INLINE float decay(float x, float flush) { return x < -flush ? 0.0f : exp_approx(x); }

// out[j] = e(to - from[j]) for j < n
void decays(float to, const float* from, int64_t n, float flush, float* out) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = decay(to - from[j], flush);
}

// One chunk of n tokens, S (dk x dv) carried in place; out_rows[i] is token i's output row (dv bf16).
void chunk(const Shape& s, Scratch& w, int64_t n, float* state, uint16_t* const* out_rows) {
  const int64_t dk = s.dk, dv = s.dv, np = n + n % 2;  // np: the product dimension over tokens, paired
  const float* cum = w.cum.data();
  float* dec = w.decays.data();
  // P and Q: [kb; q] (2n x dk) times k^T (dk x n)
  uint16_t* stacked = w.stacked.data();
  for (int64_t i = 0; i < n; ++i) {
    const float b = w.beta[i];
#pragma omp simd
    for (int64_t d = 0; d < dk; ++d) w.rows[d] = w.k[i * dk + d] * b;
    to_bf16(w.rows.data(), dk, stacked + i * dk);
    to_bf16(w.q.data() + i * dk, dk, stacked + (n + i) * dk);
  }
  vnni_transposed(w.k.data(), n, dk, w.row_b.data(), w.keys_t.data());
  float* pq = w.pq.data();
  product(2 * n, n, dk, stacked, w.keys_t.data(), pq, n, false);
  // T = (I + L)^-1 by rows: T_i = e_i - sum_{m<i} L_im T_m (T_m zero past column m); the lower Q with decays
  float* inverse = w.inverse.data();
  uint16_t* lower = w.lower.data();
  const float tiny = std::exp(-s.flush);
  const int64_t ld = (n + 15) / 16 * 16;  // T's rows padded with zeros to whole 16-lane vectors
  for (int64_t i = 0; i < n; ++i) {
    decays(cum[i], cum, i + 1, s.flush, dec);
    float* row = inverse + i * ld;
    std::fill(row, row + ld, 0.0f);
    row[i] = 1.0f;
    for (int64_t m = 0; m < i; ++m) {
      const float l = pq[i * n + m] * dec[m];
      const float* tm = inverse + m * ld;
      const int64_t width = (m + 16) / 16 * 16;  // T_m's entries past m are zero
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) row[j] -= l * tm[j];
    }
#pragma omp simd
    for (int64_t j = 0; j < i; ++j) row[j] = std::fabs(row[j]) < tiny ? 0.0f : row[j];
    float* q_row = w.rows.data();
#pragma omp simd
    for (int64_t j = 0; j < np; ++j) q_row[j] = j <= i ? pq[(n + i) * n + j] * dec[j] : 0.0f;
    to_bf16(q_row, np, lower + i * np);
  }
  // [U | W] = T [vb | kb e(c)]: T (n x np, a zero column after an odd n) times rows (np x (dv + dk))
  const int64_t wide = dv + dk;
  uint16_t* t_b = stacked;  // [kb; q] is spent
  for (int64_t i = 0; i < n; ++i) {
    float* t_row = w.rows.data();
#pragma omp simd
    for (int64_t j = 0; j < np; ++j) t_row[j] = j < n ? inverse[i * ld + j] : 0.0f;
    to_bf16(t_row, np, t_b + i * np);
  }
  float* rows = w.rows.data();
  for (int64_t i = 0; i < n; ++i) {
    const float b = w.beta[i], key_factor = b * decay(cum[i], s.flush);
#pragma omp simd
    for (int64_t d = 0; d < dv; ++d) rows[i * wide + d] = w.v[i * dv + d] * b;
#pragma omp simd
    for (int64_t d = 0; d < dk; ++d) rows[i * wide + dv + d] = w.k[i * dk + d] * key_factor;
  }
  vnni_rows(rows, wide, n, wide, w.values_keys.data());
  float* uw = w.uw.data();
  product(n, wide, np, t_b, w.values_keys.data(), uw, wide, false);
  // [W S; (q e(c)) S]: the stacked (2n x dk) times S (dk x dv)
  for (int64_t i = 0; i < n; ++i) {
    const float qd = decay(cum[i], s.flush);
    to_bf16(uw + i * wide + dv, dk, stacked + i * dk);
    float* q_row = w.rows.data();
#pragma omp simd
    for (int64_t d = 0; d < dk; ++d) q_row[d] = w.q[i * dk + d] * qd;
    to_bf16(q_row, dk, stacked + (n + i) * dk);
  }
  vnni_rows(state, dv, dk, dv, w.states.data());
  float* wso = w.wso.data();
  product(2 * n, dv, dk, stacked, w.states.data(), wso, dv, false);
  float* v_new = w.v_new.data();
  for (int64_t i = 0; i < n; ++i)
#pragma omp simd
    for (int64_t d = 0; d < dv; ++d) v_new[i * dv + d] = uw[i * wide + d] - wso[i * dv + d];
  vnni_rows(v_new, dv, n, dv, w.v_new_b.data());
  // o = (q e(c)) S + lower V'
  float* o = wso + n * dv;
  product(n, dv, np, lower, w.v_new_b.data(), o, dv, true);
  for (int64_t i = 0; i < n; ++i) to_bf16(o + i * dv, dv, out_rows[i]);
  // S = S e(c_last) + (k e(c_last - c))^T V': the decayed keys rounded by rows, then transposed
  const float last = cum[n - 1];
  decays(last, cum, n, s.flush, dec);
  uint16_t* kd = w.keys_decayed.data();
  for (int64_t i = 0; i < n; ++i) {
    float* k_row = w.rows.data();
#pragma omp simd
    for (int64_t d = 0; d < dk; ++d) k_row[d] = w.k[i * dk + d] * dec[i];
    to_bf16(k_row, dk, kd + i * dk);
  }
  uint16_t* kt = w.keys_decayed_t.data();
  for (int64_t d = 0; d < dk; ++d) {
    for (int64_t i = 0; i < n; ++i) kt[d * np + i] = kd[i * dk + d];
    if (n % 2) kt[d * np + n] = 0;
  }
  const float chunk_decay = decay(last, s.flush);
#pragma omp simd
  for (int64_t e = 0; e < dk * dv; ++e) state[e] *= chunk_decay;
  product(dk, dv, np, kt, w.v_new_b.data(), state, dv, true);
}

std::tuple<at::Tensor, at::Tensor> delta_chunks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                                                const at::Tensor& lengths, int64_t chunk_size, double flush) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && v.size(0) == q.size(0) &&
                  v.size(1) == q.size(1),
              "delta_chunks: q, k (B, T, HK, dk) and v (B, T, HV, dv), got ", q.sizes(), " ", k.sizes(), " ",
              v.sizes());
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->stride(3) == 1,
                "delta_chunks: q, k, v bf16 CPU tensors, each row contiguous, got ", t->scalar_type(), " strides ",
                t->strides());
  const int64_t batch = q.size(0), seq = q.size(1), heads_k = q.size(2), dk = q.size(3);
  const int64_t heads_v = v.size(2), dv = v.size(3);
  TORCH_CHECK(heads_k > 0 && heads_v % heads_k == 0, "delta_chunks: value heads (", heads_v,
              ") a multiple of key heads (", heads_k, ")");
  TORCH_CHECK(dk % 2 == 0 && dk > 0 && dv > 0, "delta_chunks: an even key dimension, got dk ", dk, ", dv ", dv);
  TORCH_CHECK(chunk_size > 0 && chunk_size <= 256, "delta_chunks: chunk_size in [1, 256], got ", chunk_size);
  TORCH_CHECK(flush > 0, "delta_chunks: flush > 0 (an exponent below -flush decays to zero), got ", flush);
  for (const at::Tensor* t : {&g, &beta})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->sizes() == at::IntArrayRef({batch, seq, heads_v}),
                "delta_chunks: g and beta contiguous fp32 (", batch, ", ", seq, ", ", heads_v, "), got ",
                t->scalar_type(), " ", t->sizes());
  TORCH_CHECK(state.device().is_cpu() && state.scalar_type() == at::kFloat && state.is_contiguous() &&
                  state.sizes() == at::IntArrayRef({batch, heads_v, dk, dv}),
              "delta_chunks: state contiguous fp32 (", batch, ", ", heads_v, ", ", dk, ", ", dv, "), got ",
              state.scalar_type(), " ", state.sizes());
  TORCH_CHECK(lengths.device().is_cpu() && lengths.scalar_type() == at::kLong && lengths.is_contiguous() &&
                  lengths.dim() == 1 && lengths.size(0) == batch,
              "delta_chunks: lengths a contiguous int64 (", batch, ") CPU tensor, got ", lengths.scalar_type(), " ",
              lengths.sizes());
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(len[b] >= 0 && len[b] <= seq, "delta_chunks: lengths[", b, "] = ", len[b], " outside [0, ", seq,
                "]");
  auto out = at::empty({batch, seq, heads_v, dv}, q.options());
  auto final_state = state.clone();
  const Shape shape{seq, heads_k, heads_v, dk, dv, chunk_size, static_cast<float>(flush)};
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr());
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  float* sp = final_state.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
  at::parallel_for(0, batch * heads_v, 1, [&](int64_t begin, int64_t end) {
    const TilesReleased released;
    Scratch w(shape);
    std::vector<uint16_t*> out_rows(chunk_size);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / heads_v, h = task % heads_v, hk = h / (heads_v / heads_k);
      float* s = sp + task * dk * dv;
      for (int64_t t0 = 0; t0 < len[b]; t0 += chunk_size) {
        const int64_t n = std::min(chunk_size, len[b] - t0);
        float running = 0.0f;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t t = t0 + i, gate = (b * seq + t) * heads_v + h;
          l2norm(kp + b * k.stride(0) + t * k.stride(1) + hk * k.stride(2), dk, 1.0f, w.k.data() + i * dk);
          l2norm(qp + b * q.stride(0) + t * q.stride(1) + hk * q.stride(2), dk, scale, w.q.data() + i * dk);
          const uint16_t* vr = vp + b * v.stride(0) + t * v.stride(1) + h * v.stride(2);
#pragma omp simd
          for (int64_t d = 0; d < dv; ++d) w.v[i * dv + d] = bf16_to_float(vr[d]);
          running += gp[gate];
          w.cum[i] = running;
          w.beta[i] = bp[gate];
          out_rows[i] = op + ((b * seq + t) * heads_v + h) * dv;
        }
        chunk(shape, w, n, s, out_rows.data());
      }
      for (int64_t t = len[b]; t < seq; ++t) std::fill_n(op + ((b * seq + t) * heads_v + h) * dv, dv, uint16_t{0});
    }
  });
  return {out, final_state};
}

bool delta_chunks_ready() { return brgemm_bf16() || DPBF16; }

}  // namespace hybridkv_delta_chunks
}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridkv, m) {
  m.def("delta_chunks(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor state, Tensor lengths, "
        "int chunk_size, float flush) -> (Tensor, Tensor)",
        &hybridkv_delta_chunks::delta_chunks);
  m.def("delta_chunks_ready() -> bool", &hybridkv_delta_chunks::delta_chunks_ready);
}
