"""The wheel ships every policy file, and the installed package finds them."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

# Slow and mode-independent (builds a wheel): CI runs it once per leg.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "remat_toolkit/_builtin_policies/"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  pytest.importorskip(
      "hatchling", reason="the build backend comes with the test extra: "
                          "pip install -e '.[test]'")
  out = tmp_path_factory.mktemp("wheel")
  subprocess.run(
      [sys.executable, "-m", "pip", "wheel", "--no-deps",
       "--no-build-isolation", "--quiet", "-w", str(out), str(ROOT)],
      check=True, capture_output=True, text=True, timeout=300)
  wheels = list(out.glob("remat_toolkit-*.whl"))
  assert len(wheels) == 1, wheels
  return wheels[0]


def _policy_files():
  files = sorted((ROOT / "policies").glob("*.toml"))
  assert files, "no policies/*.toml in the source tree"
  return files


def test_wheel_contains_every_policy_file(wheel):
  with zipfile.ZipFile(wheel) as zf:
    names = set(zf.namelist())
    for path in _policy_files():
      member = PREFIX + path.name
      assert member in names, f"{member} missing from {wheel.name}"
      assert zf.read(member) == path.read_bytes()
  shipped = {n for n in names if n.startswith(PREFIX)}
  assert len(shipped) == len(_policy_files())


def test_wheel_declares_the_console_script(wheel):
  with zipfile.ZipFile(wheel) as zf:
    entry_points = next(n for n in zf.namelist()
                        if n.endswith(".dist-info/entry_points.txt"))
    text = zf.read(entry_points).decode()
  assert "remat-toolkit = remat_toolkit._src.cli.main:main" in text


def test_installed_wheel_finds_its_policies(wheel, tmp_path):
  site = tmp_path / "site"
  with zipfile.ZipFile(wheel) as zf:
    zf.extractall(site)
  script = (
      "import json, remat_toolkit as rt; from remat_toolkit._src.policies import catalog; "
      "print(json.dumps([rt.__file__, str(catalog.builtin_policy_dir()), "
      "rt.list_policies()]))")
  # cwd outside the checkout, so the wheel's copy is the one imported.
  env = {**os.environ, "PYTHONPATH": str(site)}
  env.pop("REMAT_TOOLKIT_POLICY_PATH", None)
  result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path,
                          env=env, capture_output=True, text=True,
                          check=True, timeout=120)
  module_file, policy_dir, names = json.loads(result.stdout)
  assert Path(module_file).is_relative_to(site)
  assert Path(policy_dir) == site / "remat_toolkit" / "_builtin_policies"
  assert names == sorted({p.stem for p in _policy_files()}
                         | {"boundary-only", "save-everything"})
