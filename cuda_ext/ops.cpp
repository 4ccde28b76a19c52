// Defines the xmc_sparse ops from schema.h. The kernels register per dispatch key in
// cpu/uniform_sparse_cpu.cpp and cuda/uniform_sparse_cuda.cu; autograd, the fake kernels and
// autocast are registered from Python (xmc_repro/sparse/op.py).
#include <torch/library.h>

#include "schema.h"

TORCH_LIBRARY(xmc_sparse, m) {
  for (const char* schema : xmc_sparse::kSchemas) m.def(schema);
}
