"""The repository's top-level folders as subpackages of `jmoe`, when run from a source tree.

An installed jmoe (wheel or `pip install -e .`) already has `jmoe.kernels`, `jmoe.sharding`
and `jmoe.interop`: setuptools maps the folders `pallas_kernels/`, `sharding/` and `interop/`
to those names (pyproject.toml, `[tool.setuptools.package-dir]`). A tree used without
installing (`PYTHONPATH=.`, as on the GPU machines) has no such mapping, so `install()` gives
each missing name a module spec over its folder. Nothing is imported under the folders' own
names: `pallas_kernels`, `sharding` and `interop` never become top-level modules.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import pathlib
import sys

# subpackage of jmoe -> the repository folder that holds it
FOLDERS = {"kernels": "pallas_kernels", "sharding": "sharding", "interop": "interop"}
# specs of the subpackages found in the source tree, served by _SourceTreeFinder
_FOUND: dict[str, importlib.machinery.ModuleSpec] = {}


def install(package: str, package_file: str) -> None:
  """Make `package.<name>` importable for every FOLDERS entry the import system cannot find."""
  root = pathlib.Path(package_file).resolve().parent.parent
  for name, folder in FOLDERS.items():
    fullname = f"{package}.{name}"
    if fullname in sys.modules or importlib.util.find_spec(fullname) is not None:
      continue
    init = root / folder / "__init__.py"
    if not init.is_file():
      raise ImportError(f"{fullname}: neither installed nor found at {init}; "
                        "install jmoe (`pip install -e .`) or use a complete source tree")
    spec = importlib.util.spec_from_file_location(
        fullname, init, submodule_search_locations=[str(init.parent)])
    _FOUND[fullname] = spec


class _SourceTreeFinder:
  """Finds the subpackages `install` located; their own modules import the usual way."""

  @staticmethod
  def find_spec(fullname, path=None, target=None):
    return _FOUND.get(fullname)


if _SourceTreeFinder not in sys.meta_path:
  sys.meta_path.append(_SourceTreeFinder)
