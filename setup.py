"""Build hook: the wheel carries the top-level tolerances.yaml as ``verify/tolerances.yaml``.

The repository keeps one tolerance file, at its top level (reviewed with its reasons); this copies
it into the built package at build time, so an installed ``verify`` finds it with no second copy
in the tree. Everything else is in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SOURCE = Path(__file__).resolve().parent / "tolerances.yaml"


class BuildWithTolerances(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:  # an editable install reads the checkout's file itself
            self.copy_file(str(SOURCE), str(Path(self.build_lib) / "verify" / "tolerances.yaml"))


setup(cmdclass={"build_py": BuildWithTolerances})
