"""NVIDIA's Xid catalog (`xid.toml`, hand-maintained) as catalog sites with their own labels."""

from __future__ import annotations

import tomllib
from pathlib import Path

from logdx.taxonomy import taxonomy

from .templates import Site, tidy

XID_PATH = Path(__file__).with_name("xid.toml")
_IMPLICATES = ("hardware", "application", "driver")
_ROLES = ("root_cause", "symptom", "warning")


def xid_sites(path: Path = XID_PATH) -> list[Site]:
    raw = tomllib.loads(path.read_text(encoding="utf-8"))
    sites = []
    for item in raw.get("xid", []):
        _check(item, path)
        code = int(item["code"])
        messages = [tidy(m) for m in item.get("messages", [])]
        sites.append(Site(
            source="xid", package="xid", template=f"Xid {code}: {item['description']}",
            module="nvidia.driver", file=path.name, name=item.get("mnemonic") or f"Xid {code}", code=code,
            failure_type=item["failure_type"],
            extra={"implicates": item["implicates"], "role": item["role"], "messages": messages,
                   "hardware": item["implicates"] == "hardware"},
        ))
    return sites


def _check(item: dict, path: Path) -> None:
    where = f"{path}: Xid {item.get('code', '?')}"
    if item.get("failure_type") not in taxonomy().types:
        raise ValueError(f"{where}: failure_type {item.get('failure_type')!r} is not in the taxonomy")
    if item.get("implicates") not in _IMPLICATES:
        raise ValueError(f"{where}: implicates must be one of {', '.join(_IMPLICATES)}")
    if item.get("role") not in _ROLES:
        raise ValueError(f"{where}: role must be one of {', '.join(_ROLES)}")
    if not item.get("description"):
        raise ValueError(f"{where}: no description")
