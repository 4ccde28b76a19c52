"""The uniformly sparse (fixed fan-in) last layer: op, reference, layers and rewiring."""
from .checks import SparseInputError
from .layers import UniformSparseLinear, UnstructuredSparseLinear, repeated_connections_pct
from .op import backend, uniform_sparse_linear
from .rewire import reset_optimizer_state_

__all__ = ["uniform_sparse_linear", "backend", "UniformSparseLinear", "UnstructuredSparseLinear",
           "repeated_connections_pct", "reset_optimizer_state_", "SparseInputError"]
