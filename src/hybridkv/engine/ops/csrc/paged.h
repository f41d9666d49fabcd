// What the paged attention kernels (paged_decode.cpp, paged_spans.cpp) share: where a plan's entries lie in the grid,
// and what they check of their arguments before they read a byte (the entries' dtype, the grid's layout, the plan's
// types and shapes, and that every page a row's columns cover names a cell of the grid).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include "numerics.h"

namespace hybridkv_cpu {

// Row r's column c (slot c % page of the cell table[r, c / page]) and kv head h in a grid (cells, slots, page,
// kv_heads, D) of T entries: its key and its value
template <typename T>
struct PagedEntries {
  const T* base;
  const int64_t* table;
  int64_t width, page, kv_heads, d, cell_stride, key_at, value_at;

  PagedEntries(const at::Tensor& grid, const at::Tensor& cells, int64_t k_slot, int64_t v_slot)
      : base(reinterpret_cast<const T*>(grid.data_ptr())), table(cells.data_ptr<int64_t>()), width(cells.size(1)),
        page(grid.size(2)), kv_heads(grid.size(3)), d(grid.size(4)), cell_stride(grid.stride(0)),
        key_at(k_slot * grid.stride(1)), value_at(v_slot * grid.stride(1)) {}

  HYBRIDKV_INLINE const T* entry(int64_t r, int64_t c, int64_t h) const {
    return base + table[r * width + c / page] * cell_stride + ((c % page) * kv_heads + h) * d;
  }
  HYBRIDKV_INLINE const T* key(int64_t r, int64_t c, int64_t h) const { return entry(r, c, h) + key_at; }
  HYBRIDKV_INLINE const T* value(int64_t r, int64_t c, int64_t h) const { return entry(r, c, h) + value_at; }
};

// queries q (tokens, heads, D) over the grid (cells, slots, page, kv_heads, D), K and V in k_slot and v_slot; a plan
// of table (rows, pages), start and stop (rows,), all int64
inline void check_paged(const char* op, const at::Tensor& q, const at::Tensor& grid, int64_t k_slot, int64_t v_slot,
                        const at::Tensor& table, const at::Tensor& start, const at::Tensor& stop) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, op, ": bf16 or fp32 queries, got ",
              q.scalar_type());
  TORCH_CHECK(grid.scalar_type() == q.scalar_type(), op, ": queries of ", q.scalar_type(), " over a grid of ",
              grid.scalar_type(), "; cast the queries to the pool's dtype");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), op, ": contiguous (tokens, heads, D) queries");
  TORCH_CHECK(grid.dim() == 5 && grid.stride(4) == 1 && grid.stride(3) == grid.size(4) &&
                  grid.stride(2) == grid.size(3) * grid.size(4),
              op, ": a grid (cells, slots, page, kv_heads, D), each page's entries contiguous");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong && table.is_contiguous() &&
                  start.scalar_type() == at::kLong && stop.scalar_type() == at::kLong && start.is_contiguous() &&
                  stop.is_contiguous() && start.dim() == 1 && stop.dim() == 1,
              op, ": int64 table (rows, pages), start and stop (rows,)");
  TORCH_CHECK(grid.size(4) == q.size(2) && q.size(1) % grid.size(3) == 0 && table.size(0) == start.size(0) &&
                  stop.size(0) == start.size(0) && 0 <= k_slot && k_slot < grid.size(1) && 0 <= v_slot &&
                  v_slot < grid.size(1),
              op, ": shapes disagree");
}

// every page of row r's columns [start[r], stop[r]) (already checked within the table) names a cell of the grid
inline void check_cells(const char* op, const at::Tensor& grid, const at::Tensor& table, const at::Tensor& start,
                        const at::Tensor& stop) {
  const int64_t rows = start.size(0), width = table.size(1), page = grid.size(2), cells = grid.size(0);
  const int64_t* tab = table.data_ptr<int64_t>();
  const int64_t* lo = start.data_ptr<int64_t>();
  const int64_t* hi = stop.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = lo[r] / page; p <= (hi[r] - 1) / page; ++p)
      TORCH_CHECK(0 <= tab[r * width + p] && tab[r * width + p] < cells, op, ": row ", r, " cell out of range");
}

}  // namespace hybridkv_cpu
