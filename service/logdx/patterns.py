"""Text patterns several stages share: the mask that turns a line into its shape, and what a
Python traceback looks like. Data-free helpers only, so that sharing them couples no stages."""

from __future__ import annotations

import re

# One pass, one replacement: the alternation is ordered from the most to the least specific.
# Only at the start of a token that can begin a variable: most positions fail here at once.
_NOT_IN_WORD = r"(?<![\w.])"
_VARIABLE_START = r"(?=[0-9a-fA-F/~+-])"
MASK_GUARD = _NOT_IN_WORD + _VARIABLE_START
# (name, pattern) in the order they are tried. Exposed so that a benchmark can give stock drain3
# the very same masks (one `MaskingInstruction` each, behind the same guard).
MASK_ALTERNATIVES: tuple[tuple[str, str], ...] = (
    # A date inside a message, ISO ("2005-07-01", "2024-01-02T03:04:05.123Z", "2005-07-01 07:57:30").
    ("isodate", r"\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2})?(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?)?(?![\w.:-])"),
    ("uuid", r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"),
    ("ipv4", r"\d{1,3}(?:\.\d{1,3}){3}(?::\d+|<\d+>)?(?![\w.])"),  # with :port or NCCL's <port>
    ("pci", r"(?:[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?|[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])(?!\w)"),
    ("hex", r"0x[0-9a-fA-F]+\b"),
    ("path", r"~?(?:/[\w.@+=,-]+){2,}/?"),
    # number, duration, size. Atomic: a number glued to letters ("12345_7", "003a90fc", "100GBps") is not
    # cut back to a shorter one that fits ("<*>5_7", "<*>3a90fc", "<*>0GBps"); it is left whole, or is hex.
    ("num", r"(?>[-+]?\d+(?:[.,:]\d+)*(?:[eE][-+]?\d+)?)(?:ms|us|ns|s|sec|min|h|GiB|MiB|KiB|GB|MB|KB|B|%)?(?![A-Za-z_])"),
    ("longhex", r"[0-9a-fA-F]{12,}\b"),
    ("hexword", r"(?=[a-fA-F]*\d)[0-9a-fA-F]{8,}\b"),  # an address or id without 0x: 8+ hex digits, one a digit
)
# A host:port at the very start of a message ("proxy.example.com:5070 open ..."): the endpoint a line
# is about, in the place where other lines of the same event have an IP (which "ipv4" masks). Lower-case
# DNS labels only, so that "state.clipTopAmount:0" (a key and its value) stays. Only at the start: inside
# a message a host:port is as often a fixed peer whose name tells events apart.
MASK_AT_START = r"^[a-z][a-z0-9-]*(?:\.[a-z0-9-]+)+:\d+(?![\w.])"
# A date with a month name inside a message ("at Fri Jul  1 07:57:30 2005", "Jun 14 15:16:01"): ctime and
# syslog stamps. Its words are not variables of their own: masked whole, or a month would tell events apart.
_MONTHS = "(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
_DATE_WORDS = (r"(?=[A-Z][a-z]{2}[ ,])(?:(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun),? +)?"
               + _MONTHS + r" +\d{1,2},? +(?:\d{4} +)?"
               r"\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?(?: +\d{4})?(?![\w.:])")
MASK_DATE_WORDS = _NOT_IN_WORD + _DATE_WORDS
# The lookbehind once for both kinds: the regex is tried at every position of a new shape's text.
MASK = re.compile(_NOT_IN_WORD + "(?:" + _VARIABLE_START + "(?:" + "|".join(f"(?:{p})" for _, p in MASK_ALTERNATIVES)
                  + ")|" + _DATE_WORDS + ")|" + MASK_AT_START)
PARAM = "<*>"
# A host's own kernel line quoted inside another message, as health checkers and alerting tools forward
# it ("Xid errors on instance: X, Error: May 19 07:08:57 X kernel: [...] NVRM: Xid ..."): its syslog
# header names the host that printed the fault.
QUOTED_KERNEL_LINE = re.compile(r"(?<![\w:])" + _MONTHS + r" +\d{1,2} \d\d:\d\d:\d\d (?P<host>[A-Za-z0-9][\w.-]*) kernel: ")

TRACEBACK_START = "Traceback (most recent call last)"
# What Python prints before a re-raised exception's own traceback (DataLoader workers, multiprocessing
# pools, Ray): the failure that really happened is the exception that ends the block after it.
ORIGINAL_TRACEBACK = "Original Traceback (most recent call last)"
CHAINED = ("During handling of the above exception", "The above exception was the direct cause")

# An exception line: a class name (dotted or not), then ": message" or nothing. On a line of its own a
# class must look like one: its name ends like an exception (...Error, ...Exception, ...Failed), or it
# is qualified by its module (`pyarrow.lib.ArrowInvalid: ...`, `wandb.errors.Error: ...`). The line
# that closes a traceback is an exception whatever its class is called (`BackendCompilerFailed`,
# `OutOfResources`, `ZeRORuntimeException`): only the logger's level words are not.
_EXC_SUFFIX = r"(?:Error|Exception|Exit|Interrupt|Warning|Fault|Failure|Failed|Iteration|Timeout|Abort)"
_CAMEL = r"[A-Z][A-Za-z0-9_]*[a-z][A-Za-z0-9_]*"
EXCEPTION_LINE = re.compile(
    rf"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Z]\w*{_EXC_SUFFIX}\w*|KeyboardInterrupt|SystemExit|StopIteration"
    rf"|(?:[a-z_]\w*\.)+{_CAMEL}|socket\.(?:timeout|gaierror|herror|error))(?::\s?(?P<msg>.*))?$"
)
# Two processes writing one stream: a traceback's closing line gets glued to the end of another
# line ('raise ValueError(msg)ValueError', 'in dataset_info.json.ValueError') and its ": message"
# starts the next line. The class is recognised only where it is glued to what came before.
GLUED_EXCEPTION = re.compile(rf"(?<=[\w)\]'\".])(?P<type>[A-Z]\w*{_EXC_SUFFIX})$")
_ANY_EXCEPTION_LINE = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)(?::\s?(?P<msg>.*))?$")


def exception_line(text: str, *, closes_traceback: bool = False) -> re.Match[str] | None:
    """The exception a line states (groups `type`, `msg`), or None. `closes_traceback`: the line
    ends a traceback's frames, where any class name counts."""
    text = text.strip()
    m = EXCEPTION_LINE.match(text)
    if m is not None or not closes_traceback:
        return m
    m = _ANY_EXCEPTION_LINE.match(text)
    if m is None:
        return None
    name = m.group("type").rsplit(".", 1)[-1]
    if not name[0].isupper() or name.upper() == name:
        return None  # "INFO:root:...", "transformers.trainer: ..." - a logger, not a class
    return m
_BODY_PREFIXES = ("File ", "...", "^", "~", TRACEBACK_START, *CHAINED)


def mask(text: str) -> str:
    """The shape of a line: numbers, ids, addresses and paths replaced by a wildcard."""
    return MASK.sub(PARAM, text)


# Lines in a row of an interleaved traceback that are no body, before it counts as cut off.
_INTERLEAVED_STRAYS = 4


def is_interleaved_stray(text: str, writers: int, strays: int) -> bool:
    """Ranks that print the same traceback into one stream at once cut each other's lines: a code line
    loses its indent to another's "File" line. While several writers (`writers`: the tracebacks begun
    and not ended) are at it, a line that is no exception is one of theirs, not the traceback's end; a
    few in a row at most (`strays`: so far)."""
    if writers < 2 or strays >= _INTERLEAVED_STRAYS:
        return False
    return exception_line(text, closes_traceback=True) is None and GLUED_EXCEPTION.search(text.rstrip()) is None


def is_traceback_body(text: str) -> bool:
    """A line inside a traceback (frame, code, caret, rich box) rather than the exception line."""
    if not text or text[0].isspace() or text[0] in "│╭╰┃┏┗|":
        return True
    return text.startswith(_BODY_PREFIXES)


_MESSAGE_LABEL = re.compile(r"\s*[A-Za-z_][\w.]*:\s*$")  # "IndexError: ", "ERROR:root:" - part of the message


_BOX_FIELD = re.compile(r"^(\s+)traceback\s*:\s*$")


def traceback_prefix(text: str) -> str:
    """What a logger put before "Traceback (most recent call last)" on its line ("" if nothing).

    Loggers that prefix every line (`[job/task (pid 42)] [uuid] ...`) prefix every line of the
    traceback too; the frames are read after that prefix. "IndexError: Traceback ..." is a message,
    not a prefix, and the lines after it do not repeat it.
    """
    at = text.find(TRACEBACK_START)
    if at <= 0:
        return ""
    prefix = text[:at]
    if (box := _BOX_FIELD.match(prefix)) is not None:
        # torchrun's failure box ("  traceback : Traceback ..."): the error file's lines follow at the box's
        # indent, the frames further in; the indent is what every line of it carries.
        return box.group(1)
    return "" if _MESSAGE_LABEL.match(prefix) else prefix


def strip_traceback_prefix(text: str, prefix: str) -> str:
    if not prefix:
        return text
    if text.startswith(prefix):
        return text[len(prefix):]
    n = len(prefix)
    # Same column, different numbers (a timestamp that moved on): same shape counts as the prefix.
    if len(text) > n and mask(text[:n]) == mask(prefix):
        return text[n:]
    return text


def pci_key(address: str) -> str:
    """One spelling for a GPU's PCI address: "0000:47:00.0", "0000:47:00", "47:00.0" and NCCL's
    busId "47000" all become "47000"."""
    parts = re.split(r"[:.]", address.strip().lower())
    if len(parts) == 1:
        return parts[0].lstrip("0") or "0"
    if len(parts) == 2 or (len(parts) == 3 and len(parts[0]) >= 4):
        parts.append("0")  # no function number: function 0
    if len(parts) == 4:
        parts = parts[1:]  # drop the PCI domain
    return "".join(parts).lstrip("0") or "0"
