"""Build-on-first-use loader for kareus's CUDA extensions.

kareus never compiles anything when it is installed or imported. The first time a
GPU code path needs a CUDA extension (the SM-capped collectives in ``ext/collectives/``,
the stream-ordered host-function trigger in ``ext/hostfn/``), this module compiles the
sources with ``nvcc`` into a shared library and loads it with ``ctypes``. The library
holds plain ``extern "C"`` functions, so it does not depend on PyTorch's C++ ABI, and
building it takes seconds instead of the minutes a ``torch.utils.cpp_extension`` build
takes.

Builds land in a cache directory keyed by a hash of the sources, the compiler flags,
the target architecture and the compiler's version, so an edited source or another
GPU generation gets a fresh build and an unchanged one is reused across processes
and runs. Several processes (one per GPU under ``torchrun``) may ask for the same
build at once: a file lock lets one compile while the others wait, and the result
is published by an atomic rename.

Where the sources are: the top-level ``ext/`` directory of the source tree, one
subdirectory per extension. A source checkout and an editable install read them there
(``ext/`` beside the ``kareus`` package); a wheel carries a copy inside the package, at
``kareus/exec/_ext/<name>/`` (``setup.py``'s build step puts it there), found through
``importlib.resources``.

Environment variables:
    KAREUS_EXT_DIR: directory holding the extension sources, one subdirectory per
        extension (default: as above).
    KAREUS_CACHE_DIR: cache root (default: ``$XDG_CACHE_HOME/kareus`` or
        ``~/.cache/kareus``).
    KAREUS_NVCC: the ``nvcc`` to use (default: ``$CUDA_HOME/bin/nvcc``, then ``nvcc``
        on ``PATH``, then ``/usr/local/cuda/bin/nvcc``).

Everything here is pure Python; nothing imports torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from kareus.errors import ArgumentError, KareusError

__all__ = [
    "ExtensionBuildError",
    "build_shared_library",
    "cache_dir",
    "compile_object",
    "extension_source_dir",
    "find_nvcc",
    "gencode_flags",
    "load_shared_library",
    "nvcc_version",
    "source_hash",
]

# Flags shared by every build of every extension.
_COMMON_FLAGS: tuple[str, ...] = ("-O3", "-std=c++17", "-lineinfo", "-Xcompiler", "-fPIC")


class ExtensionBuildError(KareusError, RuntimeError):
    """A CUDA extension could not be found, compiled or loaded.

    The message carries the compiler's output and what to do about it.
    """


def extension_source_dir(name: str) -> Path:
    """Returns the directory holding the sources of extension ``name``.

    Args:
        name: Extension name, a subdirectory of ``ext/`` (e.g. ``"collectives"``).

    Raises:
        ExtensionBuildError: The directory does not exist.
    """
    root = os.environ.get("KAREUS_EXT_DIR")
    if root:
        bases = [Path(root)]
        if (bases[0] / name).is_dir():
            return bases[0] / name
    else:
        # The first place holding the sources (an empty folder left behind by an older
        # layout does not count).
        bases = _default_source_roots()
        for base in bases:
            if any((base / name).glob("*.cu")):
                return base / name
    raise ExtensionBuildError(
        f"CUDA sources of extension {name!r} not found in {' or '.join(map(str, bases))}; "
        "reinstall kareus, or set KAREUS_EXT_DIR to a directory that holds <name>/ with the "
        ".cu sources"
    )


def _default_source_roots() -> list[Path]:
    """Where the extension sources may be, in order: inside an installed wheel's package
    (``kareus/exec/_ext``), then ``ext/`` of the source tree the package was imported from."""
    from importlib.resources import files

    roots: list[Path] = []
    tree = files("kareus.exec") / "_ext"
    if isinstance(tree, Path):
        roots.append(tree)
    elif tree.is_dir():  # pragma: no cover - only for zipped installs: extract once
        out = cache_dir() / "src"
        for ext in tree.iterdir():
            if ext.is_dir():
                (out / ext.name).mkdir(parents=True, exist_ok=True)
                for f in ext.iterdir():
                    if f.is_file():
                        (out / ext.name / f.name).write_bytes(f.read_bytes())
        roots.append(out)
    roots.append(Path(__file__).resolve().parents[2] / "ext")
    return roots


def find_nvcc() -> str | None:
    """Returns the path of the ``nvcc`` to build with, or ``None`` when there is none."""
    explicit = os.environ.get("KAREUS_NVCC")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").is_file():
        return str(Path(cuda_home) / "bin" / "nvcc")
    on_path = shutil.which("nvcc")
    if on_path:
        return on_path
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def nvcc_version(nvcc: str) -> str:
    """Returns the last line of ``nvcc --version`` (the build string)."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    return lines[-1] if lines else "unknown"


def gencode_flags(arch: str) -> list[str]:
    """Returns nvcc flags that build machine code for exactly one architecture.

    Args:
        arch: ``"sm_90"`` style name (Hopper: H100, H200).

    Raises:
        ValueError: ``arch`` is not of the form ``sm_<digits>[a]``.
    """
    if not arch.startswith("sm_") or not arch[3:].rstrip("a").isdigit():
        raise ArgumentError(f"arch must look like 'sm_90', got {arch!r}")
    num = arch[3:]
    return [f"-gencode=arch=compute_{num},code={arch}"]


def source_hash(sources: Sequence[Path], flags: Sequence[str], extra: str = "") -> str:
    """Hashes source contents, names, compiler flags and ``extra`` (e.g. nvcc version).

    Returns:
        The first 16 hex digits of a SHA-256 digest.
    """
    h = hashlib.sha256()
    for src in sorted(sources, key=lambda p: p.name):
        h.update(src.name.encode())
        h.update(b"\0")
        h.update(Path(src).read_bytes())
        h.update(b"\0")
    h.update("\0".join(flags).encode())
    h.update(b"\0")
    h.update(extra.encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Returns the cache root for extension builds (created if missing)."""
    root = os.environ.get("KAREUS_CACHE_DIR")
    if root:
        path = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        path = (Path(xdg) if xdg else Path.home() / ".cache") / "kareus"
    path = path / "ext"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _require_nvcc() -> str:
    nvcc = find_nvcc()
    if nvcc is None:
        raise ExtensionBuildError(
            "nvcc not found: install the CUDA toolkit, or set KAREUS_NVCC or CUDA_HOME to it; "
            "kareus compiles its collective kernels on first GPU use"
        )
    return nvcc


def _run_nvcc(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        log = (proc.stdout + proc.stderr)[-8000:]
        raise ExtensionBuildError(
            f"nvcc failed to build {what} (exit {proc.returncode}); command: {' '.join(cmd)}\n{log}\n"
            "Check that nvcc supports the target architecture and that the sources are intact."
        )


def compile_object(source: Path, output: Path, *, arch: str = "sm_90") -> Path:
    """Compiles one ``.cu`` file to an object file, for compile checks without a GPU.

    nvcc compiles device code for the named architecture without needing that GPU
    (or any GPU), so this catches compile errors on a CPU-only machine.

    Args:
        source: The ``.cu`` file.
        output: Where to write the object file.
        arch: Target architecture.

    Returns:
        ``output``.

    Raises:
        ExtensionBuildError: nvcc is missing or the compile failed.
    """
    nvcc = _require_nvcc()
    cmd = [nvcc, *_COMMON_FLAGS, *gencode_flags(arch), "-c", str(source), "-o", str(output)]
    _run_nvcc(cmd, str(source))
    return output


def _define_flags(defines: Mapping[str, int | str] | None) -> list[str]:
    flags = []
    for key, value in sorted((defines or {}).items()):
        if not key.isidentifier():
            raise ArgumentError(f"macro names must be identifiers, got {key!r}")
        flags.append(f"-D{key}={value}")
    return flags


def build_shared_library(name: str, *, arch: str = "sm_90",
                         defines: Mapping[str, int | str] | None = None) -> Path:
    """Builds (or finds in the cache) the shared library of extension ``name``.

    The library is ``<cache>/ext/<name>-<arch>-<hash>/lib<name>.so``, where the hash
    covers every ``.cu``/``.cuh``/``.h`` file of ``ext/<name>/``, the flags and the
    nvcc version.

    Args:
        name: Extension name (subdirectory of ``ext/``).
        arch: Target architecture, e.g. ``"sm_90"`` for H100/H200.
        defines: Preprocessor macros (``-DKEY=VALUE``), part of the cache key.

    Returns:
        Path of the shared library.

    Raises:
        ExtensionBuildError: Sources or nvcc missing, or the build failed.
    """
    src_dir = extension_source_dir(name)
    sources = sorted(p for p in src_dir.iterdir() if p.suffix in (".cu", ".cuh", ".h"))
    units = [p for p in sources if p.suffix == ".cu"]
    if not units:
        raise ExtensionBuildError(f"no .cu sources in {src_dir}")
    nvcc = _require_nvcc()
    flags = [*_COMMON_FLAGS, *gencode_flags(arch), *_define_flags(defines), "-shared", "-cudart", "static"]
    digest = source_hash(sources, flags, extra=nvcc_version(nvcc))
    out_dir = cache_dir() / f"{name}-{arch}-{digest}"
    lib = out_dir / f"lib{name}.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    import fcntl  # POSIX only; CUDA builds are Linux-only anyway.

    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if lib.is_file():  # another process built it while we waited
                return lib
            fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
            os.close(fd)
            try:
                cmd = [nvcc, *flags, *(str(u) for u in units), "-o", tmp]
                _run_nvcc(cmd, f"extension {name!r}")
                os.replace(tmp, lib)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return lib


_LOADED: dict[tuple[str, str, tuple[tuple[str, str], ...]], ctypes.CDLL] = {}


def load_shared_library(name: str, *, arch: str = "sm_90",
                        defines: Mapping[str, int | str] | None = None) -> ctypes.CDLL:
    """Builds if needed and loads extension ``name``; cached per process.

    Raises:
        ExtensionBuildError: The build failed or the library could not be loaded.
    """
    key = (name, arch, tuple(sorted((k, str(v)) for k, v in (defines or {}).items())))
    if key not in _LOADED:
        lib = build_shared_library(name, arch=arch, defines=defines)
        try:
            _LOADED[key] = ctypes.CDLL(str(lib))
        except OSError as exc:
            raise ExtensionBuildError(
                f"could not load {lib}: {exc}; delete that directory to force a rebuild"
            ) from exc
    return _LOADED[key]
