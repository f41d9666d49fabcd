// The check every by-cell kernel (conv_decode, conv_prefill, gdn_decode) makes before it touches the state pool:
// `cells` is a contiguous int64 CPU (rows,) tensor and each entry is one of the pool's cells.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace hybridkv_cpu {

// the cells' entries, checked; `op` names the kernel in the error
inline const int64_t* checked_cells(const at::Tensor& cells, int64_t rows, int64_t pool_cells, const char* op) {
  TORCH_CHECK(cells.device().is_cpu() && cells.scalar_type() == at::kLong && cells.dim() == 1 &&
                  cells.size(0) == rows && cells.is_contiguous(),
              op, ": cells must be a contiguous int64 (R = ", rows, ",) tensor, got ", cells.scalar_type(), " ",
              cells.sizes());
  const int64_t* cell = cells.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(cell[r] >= 0 && cell[r] < pool_cells, op, ": cell ", cell[r], " of row ", r, " is outside the pool's ",
                pool_cells, " cells");
  return cell;
}

}  // namespace hybridkv_cpu
