// Queries' and keys' RMS norms and their rotary embedding in one pass over each head (hybridkv.engine.ops.qk_rope):
// no concatenated copy, no fp32 temporaries, one rounding.
//
// q (T, H, D) and k (T, KV, D), both bf16 or both fp32, each head's D entries contiguous (strides of their own
// otherwise: q may be a view beside its output gate) -> out (T, H + KV, D) of their dtype, queries' heads first. Per head: with a scale (fp32
// (H + KV, D): head j's factor row j), n = x * inv * scale, inv = 1 / sqrt(mean(x^2) + eps), the mean summed in
// fp64 (as ops.rms_norm does); without, n = x. Then the rotation of RopeTables: out[i] = n[i] cos[t, i] +
// n[partner(i)] sin[t, i] (cos, sin fp32 (T, D); partner(i) = i + R/2 for i < R/2, i - R/2 for R/2 <= i < R, i
// itself beyond the rotary dims R, where cos is 1 and sin 0), in fp32, rounded to bf16 once (nearest even) for bf16.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "numerics.h"

namespace {  // internal linkage: inlined freely (a shared library's exported functions are not)
namespace hybridkv_qk_rope {

using namespace hybridkv_cpu;


template <typename T>
void head(const T* x, const float* scale, float eps, const float* cos, const float* sin, int64_t d, int64_t rotary,
          float* n, T* out) {
  if (scale != nullptr) {
    double squares = 0.0;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < d; ++i) {
      const double v = load(x[i]);
      squares += v * v;
    }
    const float inv = 1.0f / std::sqrt(static_cast<float>(squares / static_cast<double>(d)) + eps);
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) n[i] = load(x[i]) * inv * scale[i];
  } else {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) n[i] = load(x[i]);
  }
  const int64_t half = rotary / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) store(out + i, n[i] * cos[i] + n[i + half] * sin[i]);
#pragma omp simd
  for (int64_t i = half; i < rotary; ++i) store(out + i, n[i] * cos[i] + n[i - half] * sin[i]);
#pragma omp simd
  for (int64_t i = rotary; i < d; ++i) store(out + i, n[i] * cos[i]);
}

template <typename T>
void rotate(const at::Tensor& q, const at::Tensor& k, const float* sc, float e, const at::Tensor& cos,
            const at::Tensor& sin, int64_t rotary, at::Tensor& out) {
  const int64_t t = q.size(0), hq = q.size(1), d = q.size(2), heads = hq + k.size(1);
  const auto* qd = static_cast<const T*>(q.data_ptr());
  const auto* kd = static_cast<const T*>(k.data_ptr());
  auto* od = static_cast<T*>(out.data_ptr());
  const float* cd = cos.data_ptr<float>();
  const float* sd = sin.data_ptr<float>();
  at::parallel_for(0, t * heads, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> n(d);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = r / heads, j = r % heads;
      const T* x = j < hq ? qd + i * q.stride(0) + j * q.stride(1) : kd + i * k.stride(0) + (j - hq) * k.stride(1);
      head(x, sc == nullptr ? nullptr : sc + j * d, e, cd + i * d, sd + i * d, d, rotary, n.data(), od + r * d);
    }
  });
}

void check_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat) &&
                  t.dim() == 3 && t.stride(2) == 1,
              "qk_rope: ", name, " must be a bf16 or fp32 CPU tensor (T, heads, D), each head's D entries ",
              "contiguous; got ", t.scalar_type(), " ", t.sizes(), " strides ", t.strides());
}

at::Tensor qk_rope(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& scale, double eps,
                   const at::Tensor& cos, const at::Tensor& sin, int64_t rotary) {
  check_heads(q, "q");
  check_heads(k, "k");
  const int64_t t = q.size(0), hq = q.size(1), hk = k.size(1), d = q.size(2);
  TORCH_CHECK(k.size(0) == t && k.size(2) == d, "qk_rope: q ", q.sizes(), " and k ", k.sizes(),
              " must share T and D");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == t * d && sin.numel() == t * d,
              "qk_rope: contiguous fp32 cos and sin of T x D = ", t, " x ", d, " entries");
  TORCH_CHECK(rotary >= 0 && rotary <= d && rotary % 2 == 0, "qk_rope: rotary dims ", rotary,
              " must be even and at most D = ", d);
  const float* sc = nullptr;
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->numel() == (hq + hk) * d,
                "qk_rope: the scale must be contiguous fp32 (H + KV, D) = (", hq + hk, ", ", d, "), got ",
                scale->sizes());
    sc = scale->data_ptr<float>();
  }
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "qk_rope: q (", q.scalar_type(), ") and k (", k.scalar_type(),
              ") must share a dtype");
  auto out = at::empty({t, hq + hk, d}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (q.scalar_type() == at::kFloat)
    rotate<float>(q, k, sc, static_cast<float>(eps), cos, sin, rotary, out);
  else
    rotate<uint16_t>(q, k, sc, static_cast<float>(eps), cos, sin, rotary, out);
  return out;
}

}  // namespace hybridkv_qk_rope
}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridkv, m) {
  m.def("qk_rope(Tensor q, Tensor k, Tensor? scale, float eps, Tensor cos, Tensor sin, int rotary) -> Tensor",
        &hybridkv_qk_rope::qk_rope);
}
