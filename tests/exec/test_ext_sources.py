"""The CUDA sources live in the top-level ext/, ship inside the wheel, and are found from any
install layout: a source checkout or editable install (ext/ itself), an installed wheel (the
copy in the package)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kareus.exec import _ext_build

REPO = Path(__file__).resolve().parents[2]
SOURCES = {"collectives": "kareus_collectives.cu", "hostfn": "kareus_hostfn.cu"}


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_sources_found_beside_the_package(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KAREUS_EXT_DIR", raising=False)
    found = _ext_build.extension_source_dir(name)
    assert (found / SOURCES[name]).is_file()
    package = Path(_ext_build.__file__).resolve().parents[1]
    if any((package / "exec" / "_ext" / name).glob("*.cu")):  # a wheel: the packaged copy
        assert found == package / "exec" / "_ext" / name
    else:  # a source checkout or an editable install: the top-level ext/
        assert found == package.parent / "ext" / name


def test_missing_sources_name_every_place_looked(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KAREUS_EXT_DIR", raising=False)
    roots = [tmp_path / "a", tmp_path / "b"]
    monkeypatch.setattr(_ext_build, "_default_source_roots", lambda: roots)
    with pytest.raises(_ext_build.ExtensionBuildError,
                       match=re.escape(f"not found in {roots[0]} or {roots[1]};")):
        _ext_build.extension_source_dir("collectives")
    (roots[0] / "collectives").mkdir(parents=True)  # empty, as an older layout may leave it
    (roots[1] / "collectives").mkdir(parents=True)
    (roots[1] / "collectives" / "k.cu").write_text("")
    assert _ext_build.extension_source_dir("collectives") == roots[1] / "collectives"


def test_environment_variable_still_overrides(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "collectives").mkdir()
    monkeypatch.setenv("KAREUS_EXT_DIR", str(tmp_path))
    assert _ext_build.extension_source_dir("collectives") == tmp_path / "collectives"


@pytest.mark.slow
def test_sources_found_from_an_installed_wheel(tmp_path: Path) -> None:
    """Build a wheel, install it into a plain folder, and look the sources up from there."""
    if not (REPO / "pyproject.toml").is_file():
        pytest.skip("not a source checkout")
    src = tmp_path / "src"  # a clean copy: no build/ or egg-info of the working tree
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "*.egg-info", "__pycache__", "tests", "bench", "examples",
        "data", "docs", "site", "kareus-out*"))
    wheels = tmp_path / "wheels"
    for isolation in (["--no-build-isolation"], []):  # offline with this setuptools, else
        build = subprocess.run(                       # pip fetches pyproject's build backend
            [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q",
             "-w", str(wheels), str(src)], capture_output=True, text=True, check=False)
        if not build.returncode:
            break
    else:
        pytest.skip(f"cannot build a wheel here: {build.stderr.strip()[-300:]}")
    (wheel,) = wheels.glob("kareus-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for name, file in SOURCES.items():
        assert f"kareus/exec/_ext/{name}/{file}" in names
    assert "kareus/compose/plan.schema.json" in names
    assert not any(n.startswith(("share/", "ext/")) or ".data/data/" in n for n in names)

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # what an installer puts in site-packages
    code = ("import kareus.exec._ext_build as b, kareus, pathlib; "
            "print(pathlib.Path(kareus.__file__).parent); "
            "print(b.extension_source_dir('collectives')); "
            "print(b.extension_source_dir('hostfn'))")
    env = {k: v for k, v in os.environ.items() if k != "KAREUS_EXT_DIR"}
    env["PYTHONPATH"] = str(site)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env=env, check=True).stdout.split()
    package, collectives, hostfn = (Path(p) for p in out)
    assert package == site / "kareus"
    assert (collectives / SOURCES["collectives"]).is_file() and collectives.is_relative_to(site)
    assert (hostfn / SOURCES["hostfn"]).is_file() and hostfn.is_relative_to(site)
