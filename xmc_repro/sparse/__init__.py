"""The uniformly sparse (fixed fan-in) last layer: op, reference, layers and rewiring."""
from .checks import SparseInputError
from .layers import UniformSparseLinear, UnstructuredSparseLinear, repeated_connections_pct
from .op import backend, uniform_sparse_linear

__all__ = ["uniform_sparse_linear", "backend", "UniformSparseLinear", "UnstructuredSparseLinear",
           "repeated_connections_pct", "SparseInputError"]
