"""Build logdx's error catalog from the frameworks' own code (`make catalog`).

Reads the pinned release files of `sources.toml` (downloaded from PyPI once, or the installed torch),
extracts every raise site / native error message / NCCL and CUDA runtime string, adds NVIDIA's Xid
catalog, labels each entry with logdx's taxonomy (`labels.toml` for what the taxonomy does not decide),
de-duplicates, and writes `service/logdx/kb/catalog.jsonl.gz` and `catalog.meta.json`.

    python tools/catalog/build_catalog.py [--sources FILE] [--out FILE] [--offline]

Nothing read is installed or imported; rerunning with the same sources gives the same bytes.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import sys
import time
import tomllib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `tools.catalog` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.catalog.archive import Archive, DirArchive, excluded, module_of, open_archive, package_roots
from tools.catalog.extract_binary import cudart_sites, nccl_sites, rodata_of
from tools.catalog.extract_native import extract_cxx, extract_cython, extract_rust
from tools.catalog.extract_python import PythonStats, extract_python
from tools.catalog.fetch import PYPI_JSON, FetchError, cached_release_file, new_client, sha256_of
from tools.catalog.generic import GenericMessages
from tools.catalog.label import Labeller
from tools.catalog.templates import Site, is_informative
from tools.catalog.xid import xid_sites

from logdx.diagnose.catalog import FORMAT_VERSION

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_SOURCES = HERE / "sources.toml"
DEFAULT_OUT = REPO / "service" / "logdx" / "kb" / "catalog.jsonl.gz"
DEFAULT_CACHE = REPO / ".cache" / "catalog"
MAX_BYTES = 4 * 1024 * 1024
MAX_MODULES_LISTED = 8  # an entry raised from many modules names a few of them
# When one template comes from several sources, the entry is the one whose source says most about it.
SOURCE_PRIORITY = {"xid": 0, "cudart": 1, "python": 2, "cython": 3, "rust": 4, "cxx": 5, "nccl": 6}
_NATIVE_SUFFIXES = {"cxx": (".h", ".hpp", ".cuh", ".cc", ".cpp", ".cu"), "rust": (".rs",), "cython": (".pyx", ".pxi")}


@dataclass(frozen=True)
class PackageSource:
    """One [[package]] of sources.toml."""

    name: str
    version: str
    extract: tuple[str, ...]
    modules: tuple[str, ...] = ()
    file: str | None = None
    installed: bool = False
    path: str | None = None
    native_module: str | None = None
    native_include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()


@dataclass(frozen=True)
class Sources:
    packages: tuple[PackageSource, ...]
    exclude: tuple[str, ...]
    xid_file: Path | None


@dataclass
class Release:
    """Where a package's files were read from, for the meta record."""

    name: str
    version: str
    origin: str  # pypi | installed | local
    file: str
    sha256: str | None
    archive: Archive = field(repr=False)


def load_sources(path: Path) -> Sources:
    raw = tomllib.loads(path.read_text(encoding="utf-8"))
    packages = []
    for p in raw.get("package", []):
        unknown = set(p["extract"]) - {"python", "cython", "cxx", "rust", "nccl", "cudart"}
        if unknown:
            raise ValueError(f"{path}: {p['name']}: unknown extract kinds {sorted(unknown)}")
        if not (p.get("file") or p.get("installed") or p.get("path")):
            raise ValueError(f"{path}: {p['name']}: give `file`, `installed = true` or `path`")
        packages.append(PackageSource(
            name=p["name"], version=str(p["version"]), extract=tuple(p["extract"]), modules=tuple(p.get("modules", ())),
            file=p.get("file"), installed=bool(p.get("installed")), path=p.get("path"),
            native_module=p.get("native_module"), native_include=tuple(p.get("native_include", ())),
            exclude=tuple(p.get("exclude", ()))))
    xid = raw.get("xid", {}).get("file")
    return Sources(tuple(packages), tuple(raw.get("exclude", ())), (path.parent / xid) if xid else None)


# ---- obtaining the releases --------------------------------------------------------------------

def open_release(pkg: PackageSource, cache: Path, offline: bool, index: str, base: Path) -> Release:
    if pkg.installed:
        return _installed_release(pkg)
    if pkg.path:
        local = (base / pkg.path).resolve()
        return Release(pkg.name, pkg.version, "local", local.name, sha256_of(local), open_archive(local))
    downloads = cache / "downloads"
    assert pkg.file is not None
    if offline and not (downloads / pkg.file).is_file():
        raise FetchError(f"{pkg.name}: {pkg.file} is not in {downloads} and --offline was given")
    with new_client() as client:
        path, sha = cached_release_file(pkg.name, pkg.version, pkg.file, downloads, client, index)
    return Release(pkg.name, pkg.version, "pypi", pkg.file, sha, open_archive(path))


def _installed_release(pkg: PackageSource) -> Release:
    """The package installed in this interpreter's environment, located without importing it."""
    installed = importlib.metadata.version(pkg.name)
    if installed.split("+")[0] != pkg.version:
        raise FetchError(f"{pkg.name}: sources.toml pins {pkg.version} but {installed} is installed")
    spec = importlib.util.find_spec(pkg.modules[0].split(".")[0])
    if spec is None or not spec.submodule_search_locations:
        raise FetchError(f"{pkg.name}: cannot locate the installed package {pkg.modules[0]}")
    site_packages = Path(list(spec.submodule_search_locations)[0]).parent
    return Release(pkg.name, installed, "installed", f"{pkg.name}-{installed} (installed)", None,
                   DirArchive(site_packages, pkg.modules))


# ---- extraction ----------------------------------------------------------------------------------

@dataclass
class ExtractStats:
    files: Counter[str] = field(default_factory=Counter)  # per kind
    sites: Counter[str] = field(default_factory=Counter)  # per source
    python: PythonStats = field(default_factory=PythonStats)


def extract_release(pkg: PackageSource, release: Release, sources: Sources, stats: ExtractStats) -> list[Site]:
    archive = release.archive
    patterns = sources.exclude + pkg.exclude
    names = [n for n in archive.names if not excluded(n, patterns)]
    roots = package_roots(names, pkg.modules) if pkg.modules else {}
    sites: list[Site] = []
    if "python" in pkg.extract:
        sites += _python_sites(pkg, archive, names, roots, stats)
    for kind in ("cython", "cxx", "rust"):
        if kind in pkg.extract:
            sites += _native_sites(kind, pkg, archive, names, roots, stats)
    if "nccl" in pkg.extract:
        for name in _binaries(names, "libnccl.so"):
            stats.files["nccl"] += 1
            sites += nccl_sites(rodata_of(archive.read(name)), name, pkg.name)
    if "cudart" in pkg.extract:
        for name in _binaries(names, "libcudart.so"):
            stats.files["cudart"] += 1
            sites += cudart_sites(archive.read(name), name, pkg.name)
    for site in sites:
        stats.sites[site.source] += 1
    return sites


def _python_sites(pkg: PackageSource, archive: Archive, names: list[str], roots: dict[str, str],
                  stats: ExtractStats) -> list[Site]:
    sites: list[Site] = []
    for name in names:
        if not name.endswith(".py"):
            continue
        module = module_of(name, roots)
        if module is None:
            continue
        stats.files["python"] += 1
        sites += extract_python(archive.read(name), module, name, pkg.name, name.endswith("/__init__.py"), stats.python)
    return sites


def _native_sites(kind: str, pkg: PackageSource, archive: Archive, names: list[str], roots: dict[str, str],
                  stats: ExtractStats) -> list[Site]:
    sites: list[Site] = []
    for name in names:
        if not name.endswith(_NATIVE_SUFFIXES[kind]):
            continue
        if pkg.native_include and not any(fnmatch(name, p) for p in pkg.native_include):
            continue
        stats.files[kind] += 1
        text = archive.read(name).decode("utf-8", errors="replace")
        if kind == "cxx":
            sites += extract_cxx(text, name, pkg.name, pkg.native_module)
        elif kind == "rust":
            sites += extract_rust(text, name, pkg.name, pkg.native_module)
        else:
            module = module_of(name, roots) if name.endswith(".pyx") else pkg.native_module
            sites += extract_cython(text, name, pkg.name, module or pkg.native_module or pkg.name,
                                    pkg.native_module, stats.python)
    return sites


def _binaries(names: Iterable[str], stem: str) -> list[str]:
    return sorted(n for n in names if n.rpartition("/")[2].startswith(stem))


# ---- labelling, de-duplication, output ------------------------------------------------------------

def keeps(site: Site, generic: GenericMessages) -> bool:
    """Sites worth an entry: every Xid and CUDA runtime error; elsewhere a message that says something
    and that is not one the interpreter or the OS prints anywhere."""
    if site.source in ("xid", "cudart"):
        return True
    return is_informative(site.template) and not generic.is_generic(site.template)


def build_entries(sites: list[Site], labeller: Labeller, package_order: dict[str, int]) -> list[dict]:
    """One entry per (template, exception class): the sites that print the same message from several
    modules are merged into the entry of the one that says most (source priority, then package order)."""
    ordered = sorted(sites, key=lambda s: (SOURCE_PRIORITY[s.source], package_order.get(s.package, 99),
                                           s.file or "", s.line or 0))
    merged: dict[tuple[str, str], dict] = {}
    for site in ordered:
        key = (site.template, site.qualified or site.exception or "")
        entry = merged.get(key)
        if entry is None:
            merged[key] = _entry(site, labeller)
            continue
        entry["sites"] += 1
        if site.module and site.module != entry.get("module") and site.module not in entry["modules"] \
                and len(entry["modules"]) < MAX_MODULES_LISTED:
            entry["modules"].append(site.module)
        if site.package != entry["package"] and site.package not in entry["packages"]:
            entry["packages"].append(site.package)
    entries = []
    for entry in merged.values():
        for key in ("modules", "packages"):
            if not entry[key]:
                del entry[key]
        entries.append(entry)
    entries.sort(key=lambda e: (SOURCE_PRIORITY[e["source"]], package_order.get(e["package"], 99), e["id"]))
    return entries


def _entry(site: Site, labeller: Labeller) -> dict:
    label = labeller.label(site)
    entry: dict = {
        "id": entry_id(site),
        "source": site.source,
        "package": site.package,
        "exception": site.exception,
        "qualified": site.qualified,
        "template": site.template,
        "module": site.module,
        "site": f"{site.file}:{site.line}" if site.line else site.file,
        "sites": 1,
        "failure_type": label.failure_type,
        "category": label.category,
        "label_by": label.by,
        "modules": [],
        "packages": [],
    }
    if site.name:
        entry["name"] = site.name
    if site.code is not None:
        entry["code"] = site.code
    if site.source == "cudart" and site.name:
        entry["symbols"] = [site.name]
    if site.source == "xid":
        entry["patterns"] = site.extra.get("messages", [])
        entry["symbols"] = [site.name] if site.name and not site.name.startswith("Xid ") else []
        for key in ("implicates", "role", "hardware"):
            entry[key] = site.extra[key]
    if site.extra.get("class_template"):
        entry["class_template"] = True
    return {k: v for k, v in entry.items() if v is not None}


def entry_id(site: Site) -> str:
    """Stable across rebuilds while the message and its class stay the same."""
    key = "\x1f".join([site.source, site.qualified or site.exception or "", site.template, str(site.code or "")])
    return site.source[:2] + "-" + hashlib.sha1(key.encode("utf-8")).hexdigest()[:12]


def encode_catalog(entries: list[dict]) -> bytes:
    """gzip with a fixed header (no name, no time): the same entries give the same bytes."""
    body = "".join(json.dumps(e, ensure_ascii=False, sort_keys=True, separators=(",", ":")) + "\n" for e in entries)
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9, mtime=0, filename="") as gz:
        gz.write(body.encode("utf-8"))
    return buf.getvalue()


def meta_record(entries: list[dict], releases: list[Release], stats: ExtractStats, dropped: int,
                xid_file: Path | None) -> dict:
    return {
        "format": FORMAT_VERSION,
        "generator": "tools/catalog/build_catalog.py",
        "entries": len(entries),
        "sources": [{"name": r.name, "version": r.version, "origin": r.origin, "file": r.file, "sha256": r.sha256}
                    for r in releases] + ([{"name": "xid", "origin": "hand-maintained",
                                            "file": f"tools/catalog/{xid_file.name}"}] if xid_file else []),
        "counts": {
            "by_source": dict(sorted(Counter(e["source"] for e in entries).items())),
            "by_package": dict(sorted(Counter(e["package"] for e in entries).items())),
            "by_category": dict(sorted(Counter(e["category"] for e in entries).items())),
            "by_failure_type": dict(sorted(Counter(e["failure_type"] for e in entries).items())),
            "by_label_step": dict(sorted(Counter(e["label_by"].partition(":")[0] for e in entries).items())),
        },
        "extraction": {
            "files_read": dict(sorted(stats.files.items())),
            "sites_found": dict(sorted(stats.sites.items())),
            "python_raise_sites": stats.python.raise_sites,
            "python_asserts_with_message": stats.python.asserts,
            "python_reraises_skipped": stats.python.reraises,
            "exception_class_templates": stats.python.class_templates,
            "unparsable_files": stats.python.unparsable_files,
            "dropped_uninformative_or_generic": dropped,
        },
    }


def build(sources_path: Path, out: Path, meta_path: Path, cache: Path, offline: bool = False,
          index: str = PYPI_JSON) -> dict:
    started = time.monotonic()
    sources = load_sources(sources_path)
    labeller = Labeller.load()
    stats = ExtractStats()
    releases: list[Release] = []
    sites: list[Site] = []
    for pkg in sources.packages:
        t0 = time.monotonic()
        release = open_release(pkg, cache, offline, index, sources_path.parent)
        releases.append(release)
        found = extract_release(pkg, release, sources, stats)
        sites += found
        _progress(f"{pkg.name} {release.version}: {len(found)} sites ({time.monotonic() - t0:.1f}s)")
    if sources.xid_file is not None:
        xids = xid_sites(sources.xid_file)
        stats.sites["xid"] += len(xids)
        sites += xids
    generic = GenericMessages.load()
    kept = [s for s in sites if keeps(s, generic)]
    package_order = {p.name: i for i, p in enumerate(sources.packages)}
    package_order["xid"] = len(package_order)
    entries = build_entries(kept, labeller, package_order)
    data = encode_catalog(entries)
    if len(data) > MAX_BYTES:
        raise SystemExit(f"catalog is {len(data)} bytes, over the {MAX_BYTES} bound: tighten the filters")
    meta = meta_record(entries, releases, stats, len(sites) - len(kept), sources.xid_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    meta_path.write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    _progress(f"wrote {out} ({len(data) / 1e6:.2f} MB, {len(entries)} entries from {len(sites)} sites) "
              f"in {time.monotonic() - started:.1f}s")
    return meta


def _progress(message: str) -> None:
    print(f"catalog: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", type=Path, default=DEFAULT_SOURCES, help="pinned packages (sources.toml)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="catalog to write (.jsonl.gz)")
    parser.add_argument("--meta", type=Path, default=None, help="meta record (default: beside --out)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="download cache directory")
    parser.add_argument("--index", default=PYPI_JSON, help="PyPI JSON API base URL")
    parser.add_argument("--offline", action="store_true", help="never download; use the cache only")
    args = parser.parse_args(argv)
    meta_path = args.meta or args.out.with_name(args.out.name.removesuffix(".jsonl.gz") + ".meta.json")
    try:
        build(args.sources, args.out, meta_path, args.cache, args.offline, args.index)
    except FetchError as e:
        print(f"catalog: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
