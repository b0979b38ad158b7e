"""Release files of pinned packages: found through PyPI's JSON API, downloaded once into a cache,
checked against PyPI's sha256. Nothing is installed and nothing downloaded is imported."""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urljoin

import httpx

PYPI_JSON = "https://pypi.org/pypi"
_CHUNK = 1 << 20


class FetchError(RuntimeError):
    """A release file could not be found or does not match what PyPI says it is."""


@dataclass(frozen=True, slots=True)
class ReleaseFile:
    """One file of a release as PyPI lists it."""

    filename: str
    url: str
    sha256: str
    size: int


def release_files(name: str, version: str, client: httpx.Client, index: str = PYPI_JSON) -> list[ReleaseFile]:
    """The files PyPI lists for name==version. The per-version endpoint is tried first; some mirrors
    only serve the project endpoint, whose `releases` map holds the same records."""
    by_version = client.get(f"{index}/{name}/{version}/json")
    if by_version.status_code == 200:
        return _files_of(by_version.json()["urls"], str(by_version.url))
    project = client.get(f"{index}/{name}/json")
    if project.status_code != 200:
        raise FetchError(f"{name}: PyPI answered {project.status_code} for {project.url}")
    records = project.json().get("releases", {}).get(version)
    if not records:
        raise FetchError(f"{name}: version {version} is not on PyPI")
    return _files_of(records, str(project.url))


def _files_of(records: list[dict], base_url: str) -> list[ReleaseFile]:
    # Mirrors may give URLs relative to the JSON document: resolve them against it.
    return [ReleaseFile(r["filename"], urljoin(base_url, r["url"]), r["digests"]["sha256"], int(r.get("size") or 0))
            for r in records]


def cached_release_file(name: str, version: str, filename: str, cache_dir: Path,
                        client: httpx.Client, index: str = PYPI_JSON) -> tuple[Path, str]:
    """The local path of a pinned release file and its sha256, downloading it on first use.

    A cached file is trusted only when a `.sha256` written after a verified download sits beside it.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / filename
    stamp = path.with_name(filename + ".sha256")
    if path.is_file() and stamp.is_file():
        return path, stamp.read_text().strip()
    wanted = next((f for f in release_files(name, version, client, index) if f.filename == filename), None)
    if wanted is None:
        raise FetchError(f"{name} {version}: PyPI lists no file named {filename}")
    _download(wanted, path, client)
    stamp.write_text(wanted.sha256 + "\n")
    return path, wanted.sha256


def _download(release: ReleaseFile, path: Path, client: httpx.Client) -> None:
    part = path.with_name(path.name + ".part")
    digest = hashlib.sha256()
    print(f"  downloading {release.filename} ({release.size / 1e6:.1f} MB)", file=sys.stderr, flush=True)
    with client.stream("GET", release.url) as response:
        if response.status_code != 200:
            raise FetchError(f"{release.filename}: HTTP {response.status_code} from {release.url}")
        with part.open("wb") as out:
            for chunk in response.iter_bytes(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
    if digest.hexdigest() != release.sha256:
        part.unlink(missing_ok=True)
        raise FetchError(f"{release.filename}: sha256 {digest.hexdigest()} does not match PyPI's {release.sha256}")
    part.replace(path)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def new_client() -> httpx.Client:
    return httpx.Client(timeout=httpx.Timeout(60.0, connect=20.0), follow_redirects=True,
                        headers={"User-Agent": "logdx-catalog-builder"})
