"""Memory-efficient training for extremely large output spaces (Schultheis & Babbar, ECML-PKDD 2023)."""

__version__ = "0.1.0"
