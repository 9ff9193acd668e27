"""Build step that ships the CUDA sources of ``ext/`` inside the wheel.

Everything else about the package is declared in pyproject.toml. kareus's CUDA
extension sources live in the top-level ``ext/`` directory (one subdirectory per
extension) and are compiled on first GPU use, never at install time. The wheel carries
a copy of them inside the package, at ``kareus/exec/_ext/<name>/``, where
``kareus/exec/_ext_build.py`` looks for them; a source checkout and an editable install
read ``ext/`` itself, so an editable build copies nothing.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

# Files of an extension that ship (the ones the builder hashes and compiles).
_SOURCE_SUFFIXES = (".cu", ".cuh", ".h")


class BuildPyWithExtensionSources(build_py):
    """``build_py`` that also copies ``ext/<name>/*`` to ``kareus/exec/_ext/<name>/``."""

    def _extension_sources(self) -> list[tuple[Path, Path]]:
        root = Path(__file__).resolve().parent / "ext"
        dest = Path(self.build_lib) / "kareus" / "exec" / "_ext"
        return [(src, dest / src.parent.name / src.name)
                for src in sorted(root.glob("*/*")) if src.suffix in _SOURCE_SUFFIXES]

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for src, dst in self._extension_sources():
            self.mkpath(str(dst.parent))
            self.copy_file(str(src), str(dst))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return [*outputs, *(str(dst) for _, dst in self._extension_sources())]


setup(cmdclass={"build_py": BuildPyWithExtensionSources})
