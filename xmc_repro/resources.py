"""Where the Hydra configs (conf/) and the kernel sources (cuda_ext/) are.

In a source checkout (the usual `pip install -e .`) they sit beside the package. A wheel carries copies under
`xmc_repro/_resources/` (setup.py puts them there), so `pip install .` or `pip install git+...` works too.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def resource_dir(name: str) -> Path:
    """`conf` or `cuda_ext`: the checkout's folder when there is one, else the wheel's copy."""
    for candidate in (PACKAGE.parent / name, PACKAGE / "_resources" / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"{name}/ is neither beside {PACKAGE} nor in its _resources/: reinstall xmc_repro")
