// The Python module of the engine's C++ CPU kernels (hybridkv.engine.ops.native): one binding per kernel file.
#include <torch/extension.h>

void bind_greedy(pybind11::module& m);
void bind_paged_decode(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_greedy(m);
  bind_paged_decode(m);
}
