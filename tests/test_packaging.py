"""The one import namespace: what pyproject installs matches the tree and jmoe/_layout.py, and
nothing lands on users' import path outside `jmoe`."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

import jmoe
from jmoe import _layout

ROOT = pathlib.Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _import_name(folder: pathlib.Path) -> str:
  rel = folder.relative_to(ROOT)
  top = {f: f"jmoe.{name}" for name, f in _layout.FOLDERS.items()}.get(rel.parts[0],
                                                                     rel.parts[0])
  return ".".join([top, *rel.parts[1:]])


def test_every_package_folder_is_installed_under_jmoe():
  folders = [p.parent for top in ("jmoe", *_layout.FOLDERS.values())
             for p in (ROOT / top).rglob("__init__.py")]
  names = sorted(_import_name(f) for f in folders)
  assert sorted(PYPROJECT["packages"]) == names, "pyproject's packages list is out of date"
  assert all(n == "jmoe" or n.startswith("jmoe.") for n in names)


def test_layout_matches_the_build_mapping():
  mapping = {k: v for k, v in PYPROJECT["package-dir"].items()}
  assert mapping == {f"jmoe.{name}": folder for name, folder in _layout.FOLDERS.items()}
  assert PYPROJECT["package-data"] == {"jmoe.kernels": ["configs/*.json"]}
  assert (ROOT / "pallas_kernels" / "configs").is_dir()


def test_subpackages_import_by_their_jmoe_names_from_a_bare_source_tree(tmp_path):
  """PYTHONPATH=<repo> with the installed finder removed: jmoe/_layout.py maps the folders, and
  the folders' own names never become modules."""
  code = (
      "import sys\n"
      "sys.meta_path[:] = [f for f in sys.meta_path if 'ditable' not in repr(f)]\n"
      "import jmoe, jmoe.kernels.grouped_gemm, jmoe.sharding.mesh, jmoe.interop.hf\n"
      "assert jmoe.kernels.__file__.endswith('pallas_kernels/__init__.py')\n"
      "bad = [m for m in sys.modules if m.split('.')[0] in ('pallas_kernels', 'sharding',"
      " 'interop')]\n"
      "assert not bad, bad\n"
      "print('ok')\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
                                       "PATH": "/usr/bin:/bin"}, timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
  assert jmoe.kernels.__name__ == "jmoe.kernels"
