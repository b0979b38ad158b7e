"""Error messages of native sources shipped in a release, read as text (best effort):

- C/C++: torch's `TORCH_CHECK(cond, "msg", x, ...)` family, `AT_ERROR`, `C10_THROW_ERROR(Type, ...)`,
  and Arrow's `Status::Invalid("msg", x, ...)` family (pyarrow's C++ glue);
- Cython (`.pyx`/`.pxi`): the raise statements (and the simple assignments and imports they use),
  kept at their line numbers and parsed by the Python extractor;
- Rust (PyO3 bindings, e.g. safetensors): `SomeError::new_err(format!("msg {x}"))`.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from .extract_python import PythonStats, extract_python
from .templates import WILD, Site, format_to_wild, tidy


@dataclass(frozen=True, slots=True)
class CheckMacro:
    """A C++ construct that raises: the Python class it surfaces as, and which argument the message starts at.
    `exception=None`: the class is the first argument (`C10_THROW_ERROR(ValueError, ...)`)."""

    exception: str | None
    message_arg: int


# What torch's and Arrow's error macros surface as in Python (torch/csrc/Exceptions.h, pyarrow/error.pxi).
CXX_MACROS: dict[str, CheckMacro] = {
    "TORCH_CHECK": CheckMacro("RuntimeError", 1),
    "TORCH_CHECK_VALUE": CheckMacro("ValueError", 1),
    "TORCH_CHECK_INDEX": CheckMacro("IndexError", 1),
    "TORCH_CHECK_TYPE": CheckMacro("TypeError", 1),
    "TORCH_CHECK_NOT_IMPLEMENTED": CheckMacro("NotImplementedError", 1),
    "TORCH_CHECK_WITH": CheckMacro(None, 2),  # TORCH_CHECK_WITH(ErrorType, cond, ...)
    "AT_ERROR": CheckMacro("RuntimeError", 0),
    "C10_THROW_ERROR": CheckMacro(None, 1),
    "Status::Invalid": CheckMacro("pyarrow.lib.ArrowInvalid", 0),
    "Status::TypeError": CheckMacro("pyarrow.lib.ArrowTypeError", 0),
    "Status::NotImplemented": CheckMacro("pyarrow.lib.ArrowNotImplementedError", 0),
    "Status::IOError": CheckMacro("pyarrow.lib.ArrowIOError", 0),
    "Status::KeyError": CheckMacro("pyarrow.lib.ArrowKeyError", 0),
    "Status::IndexError": CheckMacro("pyarrow.lib.ArrowIndexError", 0),
    "Status::CapacityError": CheckMacro("pyarrow.lib.ArrowCapacityError", 0),
    "Status::OutOfMemory": CheckMacro("pyarrow.lib.ArrowMemoryError", 0),
    "Status::SerializationError": CheckMacro("pyarrow.lib.ArrowSerializationError", 0),
    "Status::Cancelled": CheckMacro("pyarrow.lib.ArrowCancelled", 0),
    "Status::UnknownError": CheckMacro("pyarrow.lib.ArrowException", 0),
}
# c10 error classes -> the Python class torch translates them to (torch/csrc/Exceptions.h).
C10_TO_PYTHON = {
    "Error": "RuntimeError", "ValueError": "ValueError", "TypeError": "TypeError", "IndexError": "IndexError",
    "NotImplementedError": "NotImplementedError", "EnforceFiniteError": "RuntimeError",
    "LinAlgError": "torch.linalg.LinAlgError", "OutOfMemoryError": "torch.OutOfMemoryError",
    "AcceleratorError": "torch.AcceleratorError", "DistError": "torch.distributed.DistError",
    "DistBackendError": "torch.distributed.DistBackendError", "DistStoreError": "torch.distributed.DistStoreError",
    "DistNetworkError": "torch.distributed.DistNetworkError", "DistQueueEmptyError": "torch.distributed.DistQueueEmptyError",
}
_CXX_CALL = re.compile(r"(?<![\w:])(?:arrow::)?(" + "|".join(re.escape(m) for m in sorted(CXX_MACROS, key=len, reverse=True))
                       + r")\s*\(")
_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "'": "'", "\\": "\\", "0": ""}


def blank_comments(text: str) -> str:
    """C/C++/Rust text with comments replaced by spaces (newlines kept, so line numbers hold)."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"' or (c == "'" and i + 2 < n and (text[i + 2] == "'" or text[i + 1] == "\\")):
            j = _string_end(text, i)
            out.append(text[i:j])
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _string_end(text: str, start: int) -> int:
    """Index just after the string or char literal opening at `start`."""
    quote = text[start]
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == quote or text[i] == "\n":
            return i + 1
        i += 1
    return len(text)


def call_arguments(text: str, open_paren: int) -> list[str] | None:
    """The top-level comma-separated arguments of the call whose '(' is at `open_paren`, or None when
    it does not close (a macro definition cut short, a parse we cannot follow)."""
    args: list[str] = []
    depth, start, i = 0, open_paren + 1, open_paren
    while i < len(text):
        c = text[i]
        if c == '"' or c == "'":
            i = _string_end(text, i)
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                args.append(text[start:i].strip())
                return [a for a in args if a]
        elif c == "," and depth == 1:
            args.append(text[start:i].strip())
            start = i + 1
        i += 1
    return None


_LITERAL = re.compile(r'\s*(?:u8|L|u|U)?"((?:[^"\\\n]|\\.)*)"\s*')


def literal_text(arg: str) -> str | None:
    """The text of an argument made only of adjacent string literals ("a" "b"), else None."""
    pos, parts = 0, []
    while pos < len(arg):
        m = _LITERAL.match(arg, pos)
        if not m:
            return None
        parts.append(re.sub(r"\\(.)", lambda e: _ESCAPES.get(e.group(1), e.group(1)), m.group(1)))
        pos = m.end()
    return "".join(parts) if parts else None


def concatenated_message(args: list[str]) -> str:
    """`c10::str`/`StringBuilder` semantics: every argument printed one after the other."""
    return "".join(t if (t := literal_text(a)) is not None else WILD for a in args)


def extract_cxx(text: str, file: str, package: str, module: str | None) -> list[Site]:
    clean = blank_comments(text)
    sites: list[Site] = []
    for m in _CXX_CALL.finditer(clean):
        line_start = clean.rfind("\n", 0, m.start()) + 1
        if clean[line_start:m.start()].lstrip().startswith("#"):
            continue  # the macro's own #define
        args = call_arguments(clean, m.end() - 1)
        if args is None:
            continue
        macro = CXX_MACROS[m.group(1)]
        exception = macro.exception
        if exception is None:
            if not args:
                continue
            exception = C10_TO_PYTHON.get(args[0].removeprefix("c10::").removeprefix("::c10::"), args[0])
        template = tidy(concatenated_message(args[macro.message_arg:]))
        sites.append(Site(source="cxx", package=package, template=template, exception=exception.rpartition(".")[2],
                          qualified=exception, module=module, file=file, line=clean.count("\n", 0, m.start()) + 1,
                          extra={"macro": m.group(1)}))
    return sites


# ---- Cython ---------------------------------------------------------------------------------------

_CYTHON_KEEP = re.compile(r"^\s*(?:raise\s|from\s+\S+\s+import\s|[A-Za-z_]\w*\s*\+?=[^=])")


def python_subset_of_cython(text: str) -> str:
    """A Python module holding only the raise statements, simple assignments and imports of a Cython
    file, each at column 0 and at its own line number; everything else is blank. Cython-only syntax
    (`<object>x` casts, `cdef`) fails to parse and is dropped statement by statement."""
    lines = text.splitlines()
    out = [""] * len(lines)
    i = 0
    while i < len(lines):
        if not _CYTHON_KEEP.match(lines[i]):
            i += 1
            continue
        end = i
        stmt = lines[i].strip()
        while _open_brackets(stmt) > 0 and end + 1 < len(lines) and end - i < 40:
            end += 1
            stmt += "\n" + lines[end].strip()
        try:
            ast.parse(stmt)
        except SyntaxError:
            i += 1
            continue
        for k, part in enumerate(stmt.split("\n")):
            out[i + k] = part
        i = end + 1
    return "\n".join(out)


def _open_brackets(text: str) -> int:
    depth, i = 0, 0
    while i < len(text):
        c = text[i]
        if c in "\"'":
            i = _string_end(text, i)
            continue
        depth += c in "([{"
        depth -= c in ")]}"
        i += 1
    return depth


def extract_cython(text: str, file: str, package: str, module: str, native_module: str | None,
                   stats: PythonStats) -> list[Site]:
    sites = extract_python(python_subset_of_cython(text), module, file, package, False, stats, kind="cython")
    for site in sites:
        # Classes a .pxi raises are defined in the extension module it is compiled into (pyarrow.lib).
        if site.qualified is None and site.exception and native_module and "." not in site.exception:
            site.qualified = f"{native_module}.{site.exception}"
    return sites


# ---- Rust (PyO3) ------------------------------------------------------------------------------------

_RUST_NEW_ERR = re.compile(r"\b([A-Z]\w*)::new_err\s*\(")
_RUST_FORMAT = re.compile(r"^format!\s*\(")


def extract_rust(text: str, file: str, package: str, module: str | None) -> list[Site]:
    clean = blank_comments(text)
    sites: list[Site] = []
    for m in _RUST_NEW_ERR.finditer(clean):
        args = call_arguments(clean, m.end() - 1)
        if not args:
            continue
        template = _rust_message(args[0])
        if template is None:
            continue
        written = m.group(1)
        # PyO3 spells Python's builtins PyValueError, PyFileNotFoundError...
        python_name = written[2:] if written.startswith("Py") and written[2:3].isupper() else written
        qualified = python_name if python_name != written else (f"{module}.{written}" if module else written)
        sites.append(Site(source="rust", package=package, template=tidy(template), exception=python_name,
                          qualified=qualified, module=module, file=file, line=clean.count("\n", 0, m.start()) + 1))
    return sites


def _rust_message(arg: str) -> str | None:
    """`format!("text {x}")` or a plain literal; None for a message built any other way."""
    fmt = _RUST_FORMAT.match(arg)
    if fmt:
        inner = call_arguments(arg, fmt.end() - 1)
        text = literal_text(inner[0]) if inner else None
        return format_to_wild(text) if text is not None else None
    return literal_text(arg.removesuffix(".to_string()").removesuffix(".into()").strip())
