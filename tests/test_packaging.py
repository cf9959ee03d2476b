"""tinytron installs as a regular (non-editable) package too: every chapter module lands under its import name."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile

from tests.conftest import ROOT


def test_wheel_holds_every_chapter_module_and_imports(tmp_path):
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheel_dir), str(ROOT)], check=True, timeout=300, capture_output=True)
    (wheel,) = wheel_dir.glob("tinytron-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    expected = set()
    for package, folder in package_dir.items():
        for module in (ROOT / folder).glob("*.py"):
            expected.add("/".join(package.split(".")) + "/" + module.name)
    missing = sorted(expected - names)
    assert not missing, f"the wheel lacks {missing}"

    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    str(wheel)], check=True, timeout=300, capture_output=True)
    env = dict(os.environ, PYTHONPATH=str(target))
    code = ("import tinytron, tinytron.parallel, tinytron.model, tinytron.data, tinytron.buffers, "
            "tinytron.optimizer, tinytron.overview, tinytron.launch; print(tinytron.__file__)")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, check=True,
                         capture_output=True, text=True, timeout=300).stdout
    assert out.strip().startswith(str(target)), f"imported from {out.strip()}, not the regular install"
