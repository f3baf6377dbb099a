"""verl's fused linear cross-entropy kernel, loaded without verl's package ``__init__``.

``verl.utils.kernel.linear_cross_entropy(hidden, weight, labels, temperature, reduction,
dist_process_group)`` returns per-token log-probs and entropy (AReaL and SkyRL vendor it). verl's
top-level ``__init__`` pulls in ray, transformers and its trainers; the kernel needs none of them.
`load` registers bare package entries for ``verl`` and ``verl.utils`` (their ``__path__`` only, so
no ``__init__`` runs) and then imports the real kernel modules, which import the real
``verl.utils.device`` and ``verl.plugin.platform`` from the same tree.

Where verl is found: the directory or wheel named by ``VERL_PATH`` (a ``.whl`` is imported in
place, as a zip), else an installed ``verl`` distribution (``pip install --no-deps verl``).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import zipfile
from pathlib import Path
from types import ModuleType

from verify.adapters.interface import AdapterError

ENV = "VERL_PATH"
KERNEL = "verl.utils.kernel.linear_cross_entropy"
MODULES = (KERNEL, "verl.utils.kernel.kernels")  # the second is imported lazily by the first
# Packages whose __init__ is skipped: verl's imports ray/transformers, verl.utils' its tokenizers.
BARE = ("verl", "verl.utils")


def load() -> ModuleType:
    """The real ``verl.utils.kernel.linear_cross_entropy`` module (its Triton kernels imported
    too, so a missing dependency shows here); `AdapterError` says how to get verl."""
    if KERNEL in sys.modules:
        return sys.modules[KERNEL]
    root = _root()
    for name in BARE:
        if name not in sys.modules:
            sys.modules[name] = _bare_package(name, os.path.join(root, *name.split(".")))
    try:
        kernel, _ = (importlib.import_module(name) for name in MODULES)
    except ImportError as exc:
        raise AdapterError(f"verl's kernel modules under {root} did not import: {exc}") from exc
    return kernel


def version() -> str:
    """verl's version, from its ``verl/version/version`` file (where its __init__ reads it)."""
    root, name = Path(_root()), "verl/version/version"
    text = zipfile.Path(root, name).read_text() if root.is_file() else (root / name).read_text()
    return text.strip()


def _root() -> str:
    """The directory (or wheel) that holds the ``verl`` package."""
    given = os.environ.get(ENV)
    if given:
        path = Path(given)
        if not (path / "verl").is_dir() and not (path.is_file() and path.suffix == ".whl"):
            raise AdapterError(
                f"{ENV}={given!r} is neither a directory holding verl/ nor a verl .whl file"
            )
        return str(path)
    spec = importlib.util.find_spec("verl")  # finds it without running verl/__init__.py
    if spec is None or not spec.submodule_search_locations:
        raise AdapterError(
            "verl is not installed: `pip install --no-deps verl` (only its kernel modules are "
            f"imported), or set {ENV} to a verl wheel or source tree"
        )
    return str(Path(next(iter(spec.submodule_search_locations))).parent)


def _bare_package(name: str, path: str) -> ModuleType:
    """A package entry whose submodules are found under ``path`` and whose __init__ never runs."""
    module = ModuleType(name, f"bare package entry for {name} (lce's verl adapter)")
    module.__path__ = [path]
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__spec__.submodule_search_locations = [path]
    module.__package__ = name
    return module
