"""Everything is in pyproject.toml; this only adds conf/ and cuda_ext/ to built wheels (see xmc_repro/resources.py)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

RESOURCES = ("conf", "cuda_ext")


class BuildPyWithResources(build_py):
    def run(self):
        super().run()
        if self.editable_mode:  # an editable install reads them from the checkout
            return
        for name in RESOURCES:
            shutil.copytree(name, Path(self.build_lib) / "xmc_repro" / "_resources" / name, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.o"))


setup(cmdclass={"build_py": BuildPyWithResources})
