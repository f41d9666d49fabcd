// A step's new token entries put straight into their places (hybridkv.engine.ops.put_entries, which says when the
// engine takes it): a pool's pages at (cell, offset), or the step's gathered buffer at its columns.
//
// dst is (A, S, B, E) with E contiguous (a grid (cells, slots, page, entry), or a buffer seen as (columns, slots, 1,
// entry)); src holds one (T, E) tensor per slot written, slot0 onwards (rows of any stride, E contiguous). Token t's
// entry of slot0 + s goes to dst[index[t], slot0 + s, offset[t]] (offset 0 when not given): a byte copy, so the
// result is bit-equal to the indexed stores it replaces. Every index is checked before anything is written.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <c10/util/Optional.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {  // internal linkage: inlined freely (a shared library's exported functions are not)
namespace hybridkv_put_entries {

void put_entries(const at::Tensor& dst, int64_t slot0, at::TensorList src, const at::Tensor& index,
                 const c10::optional<at::Tensor>& offset) {
  TORCH_CHECK(dst.dim() == 4 && dst.stride(3) == 1 && dst.device().is_cpu(),
              "put_entries: dst must be a CPU (A, slots, B, entry) tensor with contiguous entries, got ", dst.sizes(),
              " strides ", dst.strides());
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong && index.is_contiguous(),
              "put_entries: index must be a contiguous int64 (T,) tensor");
  const int64_t tokens = index.size(0), entry = dst.size(3), width = static_cast<int64_t>(src.size());
  TORCH_CHECK(0 <= slot0 && slot0 + width <= dst.size(1), "put_entries: slots [", slot0, ", ", slot0 + width,
              ") are outside dst's ", dst.size(1));
  const int64_t* offs = nullptr;
  if (offset.has_value()) {
    const at::Tensor& o = *offset;
    TORCH_CHECK(o.dim() == 1 && o.scalar_type() == at::kLong && o.is_contiguous() && o.size(0) == tokens,
                "put_entries: offset must be a contiguous int64 tensor of index's ", tokens, " tokens");
    offs = o.data_ptr<int64_t>();
  }
  const int64_t item = dst.element_size(), bytes = entry * item;
  std::vector<const char*> from(width);
  std::vector<int64_t> row(width);
  for (int64_t s = 0; s < width; ++s) {
    const at::Tensor& x = src[s];
    TORCH_CHECK(x.dim() == 2 && x.size(0) == tokens && x.size(1) == entry && x.stride(1) == 1 && x.device().is_cpu() &&
                    x.scalar_type() == dst.scalar_type(),
                "put_entries: src ", s, " must be (", tokens, ", ", entry, ") ", dst.scalar_type(),
                " with contiguous entries, got ", x.sizes(), " ", x.scalar_type());
    from[s] = static_cast<const char*>(x.data_ptr());
    row[s] = x.stride(0) * item;
  }
  const int64_t* at = index.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(0 <= at[t] && at[t] < dst.size(0), "put_entries: token ", t, "'s index ", at[t], " is outside dst's ",
                dst.size(0));
    TORCH_CHECK(offs == nullptr || (0 <= offs[t] && offs[t] < dst.size(2)), "put_entries: token ", t, "'s offset ",
                offs == nullptr ? 0 : offs[t], " is outside dst's ", dst.size(2));
  }
  char* base = static_cast<char*>(dst.data_ptr());
  const int64_t s0 = dst.stride(0) * item, s1 = dst.stride(1) * item, s2 = dst.stride(2) * item;
  for (int64_t t = 0; t < tokens; ++t) {
    char* place = base + at[t] * s0 + (offs == nullptr ? 0 : offs[t] * s2) + slot0 * s1;
    for (int64_t s = 0; s < width; ++s) std::memcpy(place + s * s1, from[s] + t * row[s], bytes);
  }
}

}  // namespace hybridkv_put_entries
}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridkv, m) {
  m.def("put_entries(Tensor(a!) dst, int slot0, Tensor[] src, Tensor index, Tensor? offset) -> ()",
        &hybridkv_put_entries::put_entries);
}
