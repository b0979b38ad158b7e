"""Read-only views of a release: a wheel (zip), an sdist (tar.gz) or an installed package directory,
all with the same two operations, and the dotted module each source file belongs to."""

from __future__ import annotations

import tarfile
import zipfile
from collections.abc import Iterable
from fnmatch import fnmatch
from pathlib import Path

from logdx.taxonomy import module_of_path

# Suffixes of the files any extractor reads; an sdist is loaded in one pass, so it keeps only these.
SOURCE_SUFFIXES = (".py", ".pyx", ".pxi", ".h", ".hpp", ".cuh", ".cc", ".cpp", ".cu", ".rs")


class Archive:
    """The files of one release: `names` (relative, '/'-separated) and `read(name)`."""

    names: list[str]

    def read(self, name: str) -> bytes:
        raise NotImplementedError


class ZipArchive(Archive):
    def __init__(self, path: Path) -> None:
        self._zip = zipfile.ZipFile(path)
        self.names = [i.filename for i in self._zip.infolist() if not i.is_dir()]

    def read(self, name: str) -> bytes:
        return self._zip.read(name)


class TarArchive(Archive):
    """An sdist. Gzip cannot seek back cheaply, so the source files are read in one pass up front;
    a binary member is re-read on demand (sdists rarely hold any)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._sources: dict[str, bytes] = {}
        self.names = []
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                self.names.append(member.name)
                if member.name.endswith(SOURCE_SUFFIXES):
                    self._sources[member.name] = tar.extractfile(member).read()  # type: ignore[union-attr]

    def read(self, name: str) -> bytes:
        if name in self._sources:
            return self._sources[name]
        with tarfile.open(self._path, "r:*") as tar:
            return tar.extractfile(name).read()  # type: ignore[union-attr]


class DirArchive(Archive):
    """An installed package: `root` is the site-packages directory, names are relative to it."""

    def __init__(self, root: Path, top_levels: Iterable[str]) -> None:
        self._root = root
        self.names = []
        for top in top_levels:
            base = root / top.split(".")[0]
            if base.is_dir():
                self.names += [p.relative_to(root).as_posix() for p in sorted(base.rglob("*")) if p.is_file()]

    def read(self, name: str) -> bytes:
        return (self._root / name).read_bytes()


def open_archive(path: Path) -> Archive:
    if path.suffix in (".whl", ".zip"):
        return ZipArchive(path)
    if path.name.endswith((".tar.gz", ".tgz", ".tar")):
        return TarArchive(path)
    raise ValueError(f"{path}: not a wheel or an sdist")


def package_roots(names: Iterable[str], import_names: Iterable[str]) -> dict[str, str]:
    """Where each import package starts inside the archive: {"deepspeed-0.19.8/deepspeed/": "deepspeed"}.

    A root is the first place the package's directory holds an `__init__.py` (an sdist may nest the
    package under `src/` or `bindings/python/py_src/`); a namespace package ("megatron.core") is named
    by its dotted path and found by the regular package inside it.
    """
    present = set(names)
    roots: dict[str, str] = {}
    for dotted in import_names:
        rel = dotted.replace(".", "/") + "/__init__.py"
        candidates = sorted((n[: -len("__init__.py")] for n in present if n == rel or n.endswith("/" + rel)), key=len)
        if candidates:
            roots[candidates[0]] = dotted  # the shallowest: "pkg-1.0/src/pkg/", not a copy under tests/
    return roots


def module_of(name: str, roots: dict[str, str]) -> str | None:
    """The dotted module of an archive path, or None when it lies outside every package root."""
    for root in roots:
        if name.startswith(root):
            base = root[: -len(roots[root].replace(".", "/") + "/")]
            return module_of_path("site-packages/" + name[len(base):])
    return None


def excluded(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch(name, p) for p in patterns)
