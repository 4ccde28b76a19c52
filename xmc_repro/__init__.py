"""Memory-efficient training for extremely large output spaces (Schultheis & Babbar, ECML-PKDD 2023)."""

__version__ = "0.1.0"

# Registers conf/'s resolver wherever the package is imported, so every way of composing conf/ resolves it.
import xmc_repro.validation  # noqa: E402, F401
