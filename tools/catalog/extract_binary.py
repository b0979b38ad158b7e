"""Error strings of shared objects shipped in NVIDIA's wheels, read as bytes (never loaded):

- NCCL (`libnccl.so*`): the printable strings that are failure messages: the format strings of its
  WARN lines and of `ncclGetErrorString`, printf conversions turned into `<*>`;
- CUDA runtime (`libcudart.so*`): the texts of `cudaGetErrorString` paired with their `cudaError_t`
  names and codes, through the table the library keeps them in ({code, name, text} records whose
  pointers are ELF relative relocations).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from .templates import Site, is_informative, printf_to_wild, tidy

_PRINTABLE = re.compile(rb"[\x20-\x7e\t]{6,}")


def printable_strings(data: bytes) -> list[str]:
    """What `strings -n 6` prints: runs of printable ASCII."""
    return [m.group().decode("ascii") for m in _PRINTABLE.finditer(data)]


# ---- NCCL ------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StringFilter:
    """Which strings of a binary are failure messages: at least one failure word, enough words, and none
    of the shapes of non-messages (symbols, paths, env var names, code)."""

    failure_words: re.Pattern[str]
    rejects: re.Pattern[str]
    min_words: int = 3


NCCL_FILTER = StringFilter(
    failure_words=re.compile(
        r"(?i)\b(?:fail(?:ed|ure|s)?|error|errno|timed? ?out|timeout|abort(?:ed|ing)?|unable|cannot|can't|could not|"
        r"couldn't|invalid|mismatch|unhandled|refused|closed|lost|exceed(?:ed|s)?|out of memory|no space|"
        r"unexpected|unsupported|not supported|corrupt|truncated|exited|crash|panic|broken|denied|"
        r"illegal|violation|fatal|hang|stuck|retry|retries|disconnect(?:ed)?|unreachable|no route|vendor.?err)\b"),
    rejects=re.compile(
        r"^[\w.:/$@-]+$"  # one token: a symbol, a path, an env var name
        r"|^_Z|\b(?:GLIBC|GCC|CXXABI)_|\.(?:c|cc|cpp|cu|h)\b|^\s*[#{}]"
        r"|[{};]\s*$|\bPTX\b|^\.[a-z]"  # code and PTX
    ),
)
# NCCL's WARN lines begin with a subsystem tag ("NET/IB : ", "Proxy Call : ") or a "%s:%d" source
# location; both vary by build, and the tag is kept since it names the subsystem.
_NCCL_LOCATION_PREFIX = re.compile(r"^%s:%d -> %d\s*")


def nccl_sites(data: bytes, file: str, package: str) -> list[Site]:
    sites: list[Site] = []
    seen: set[str] = set()
    for text in printable_strings(data):
        text = text.strip()
        if len(text) > 400 or NCCL_FILTER.rejects.search(text) or not NCCL_FILTER.failure_words.search(text):
            continue
        template = tidy(printf_to_wild(_NCCL_LOCATION_PREFIX.sub("", text)))
        if len(re.findall(r"[A-Za-z]{2,}", template)) < NCCL_FILTER.min_words or not is_informative(template):
            continue
        if template in seen:
            continue
        seen.add(template)
        sites.append(Site(source="nccl", package=package, template=template, module="nccl", file=file))
    return sites


# ---- ELF: the CUDA runtime's error table --------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Section:
    name: str
    kind: int
    addr: int
    offset: int
    size: int


_SHT_NOBITS = 8
_R_X86_64_RELATIVE = 8


class Elf:
    """The little of a 64-bit little-endian ELF file needed to follow relocated string pointers."""

    def __init__(self, data: bytes) -> None:
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            raise ValueError("not a 64-bit little-endian ELF file")
        self.data = data
        shoff = struct.unpack_from("<Q", data, 0x28)[0]
        entsize, count, strndx = struct.unpack_from("<HHH", data, 0x3A)
        raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * entsize) for i in range(count)]
        names_at = raw[strndx][4]
        self.sections = [Section(self._cstring_at(names_at + r[0]), r[1], r[3], r[4], r[5]) for r in raw]

    def _cstring_at(self, offset: int) -> str:
        end = self.data.index(b"\0", offset)
        return self.data[offset:end].decode("latin-1")

    def offset_of(self, addr: int) -> int | None:
        for s in self.sections:
            if s.kind != _SHT_NOBITS and s.addr and s.addr <= addr < s.addr + s.size:
                return s.offset + addr - s.addr
        return None

    def string_at(self, addr: int) -> str | None:
        offset = self.offset_of(addr)
        if offset is None:
            return None
        end = self.data.find(b"\0", offset, offset + 1024)
        raw = self.data[offset:end] if end >= 0 else b""
        return raw.decode("ascii") if raw and all(32 <= b < 127 for b in raw) else None

    def relative_relocations(self) -> dict[int, int]:
        """{address of a pointer slot: address it points to} for R_X86_64_RELATIVE relocations."""
        out: dict[int, int] = {}
        for s in self.sections:
            if s.name.startswith(".rela"):
                for i in range(0, s.size - 23, 24):
                    where, info, addend = struct.unpack_from("<QQq", self.data, s.offset + i)
                    if info & 0xFFFFFFFF == _R_X86_64_RELATIVE:
                        out[where] = addend
        return out

    def int32_at(self, addr: int) -> int | None:
        offset = self.offset_of(addr)
        return struct.unpack_from("<i", self.data, offset)[0] if offset is not None else None


@dataclass(frozen=True, slots=True)
class CudaError:
    code: int
    name: str
    text: str


def cudart_error_table(data: bytes) -> list[CudaError]:
    """The {code, name, text} records behind cudaGetErrorName/cudaGetErrorString: a pointer to a
    "cudaError..." name, the pointer after it to the text, the int before it the code."""
    elf = Elf(data)
    pointers = elf.relative_relocations()
    table: dict[int, CudaError] = {}
    for slot, target in sorted(pointers.items()):
        name = elf.string_at(target)
        if not name or not (name.startswith("cudaError") or name == "cudaSuccess"):
            continue
        text = elf.string_at(pointers[slot + 8]) if slot + 8 in pointers else None
        code = elf.int32_at(slot - 8)
        if text and code is not None and code not in table and not text.startswith("cuda"):
            table[code] = CudaError(code, name, text)
    return [table[c] for c in sorted(table)]


def cudart_sites(data: bytes, file: str, package: str) -> list[Site]:
    sites = []
    for err in cudart_error_table(data):
        if err.code == 0:
            continue  # cudaSuccess: "no error"
        sites.append(Site(source="cudart", package=package, template=tidy(err.text), exception=None,
                          module="cudart", file=file, name=err.name, code=err.code))
    return sites


def rodata_of(data: bytes) -> bytes:
    """The read-only data of an ELF file, where its string constants live (a few hundred KB of a
    500 MB libnccl whose bulk is GPU code); the whole file when it cannot be parsed."""
    try:
        elf = Elf(data)
    except (ValueError, struct.error):
        return data
    parts = [data[s.offset:s.offset + s.size] for s in elf.sections if s.name.startswith(".rodata")]
    return b"\0".join(parts) if parts else data
