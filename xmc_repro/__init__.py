"""Memory-efficient training for extremely large output spaces (Schultheis & Babbar, ECML-PKDD 2023)."""

__version__ = "0.1.0"

from omegaconf import OmegaConf as _OmegaConf

from xmc_repro.validation import UNSTRUCTURED_REWIRE_RESOLVER as _NAME
from xmc_repro.validation import authors_unstructured_rewire_fraction as _fraction

# Registered wherever the package is imported, so every way of composing conf/ resolves it.
_OmegaConf.register_new_resolver(_NAME, _fraction, replace=True)
