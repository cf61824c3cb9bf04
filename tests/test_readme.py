"""Every ```python block of README.md (and of docs/*.md) runs as written.

Each block runs alone in a fresh `python` process from the repository root, with the
environment of a new shell on a CPU machine: JAX_PLATFORMS=cpu, and no XLA_FLAGS or JMOE_*
settings inherited from this test process (conftest.py sets XLA_FLAGS for 8 simulated devices;
a README block that needs them must set them itself, as a reader would). Other fenced blocks
(```bash: the set-up commands) are not run. Blocks that import torch / transformers run too:
the `test` extra installs both.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
TIMEOUT_S = 300


def _sources() -> list[pathlib.Path]:
  return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def _slug(text: str) -> str:
  return re.sub(r"[^0-9A-Za-z]+", "-", text).strip("-").lower() or "top"


def python_blocks(path: pathlib.Path) -> list[tuple[str, str]]:
  """(id, code) of each ```python block in `path`; the id names the heading above it."""
  text = path.read_text(encoding="utf-8")
  headings = [(m.start(), m.group(1)) for m in HEADING.finditer(text)]
  out, seen = [], {}
  for m in FENCE.finditer(text):
    if m.group(1).strip().split()[:1] not in (["python"], ["py"]):
      continue
    above = [h for pos, h in headings if pos < m.start()]
    name = _slug(above[-1] if above else "top")
    prefix = "" if path.name == "README.md" else f"{path.stem}-"
    base = prefix + name
    seen[base] = seen.get(base, 0) + 1
    out.append((base if seen[base] == 1 else f"{base}-{seen[base]}", m.group(2)))
  return out


def _cases():
  cases = []
  for path in _sources():
    if path.is_file():
      for name, code in python_blocks(path):
        cases.append(pytest.param(path.relative_to(ROOT).as_posix(), code, id=name))
  return cases


def _fresh_env() -> dict[str, str]:
  env = {k: v for k, v in os.environ.items()
         if k != "XLA_FLAGS" and not k.startswith("JMOE_")}
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONUNBUFFERED"] = "1"
  return env


def test_readme_has_python_blocks():
  names = [name for name, _ in python_blocks(ROOT / "README.md")]
  assert len(names) >= 5, names
  assert len(set(names)) == len(names), names


def test_block_extraction_skips_other_languages(tmp_path):
  md = tmp_path / "probe.md"
  md.write_text(textwrap.dedent("""\
      # Title
      ```bash
      echo not python
      ```
      ## Part one
      ```python
      print(1)
      ```
      ```python
      print(2)
      ```
      """), encoding="utf-8")
  assert python_blocks(md) == [("probe-part-one", "print(1)\n"),
                               ("probe-part-one-2", "print(2)\n")]


@pytest.mark.parametrize("source, code", _cases())
def test_block_runs(source, code):
  try:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_fresh_env(),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired as e:
    err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
    pytest.fail(f"{source}: block ran past {TIMEOUT_S} s:\n{code}\n--- stderr ---\n{err}",
                pytrace=False)
  if proc.returncode != 0:
    pytest.fail(f"{source}: block exited {proc.returncode}:\n{code}\n"
                f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}", pytrace=False)
