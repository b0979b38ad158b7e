"""Timestamps in the formats training logs print them.

Everything is UTC so that a generated log does not depend on the machine's time zone. The hot
path (Python-logging stamps on millions of progress lines) caches the per-second part.
"""

from __future__ import annotations

import time


class Clock:
    """Formats epoch seconds (floats) the ways launchers, frameworks and kernels do."""

    def __init__(self) -> None:
        self._seconds: dict[int, str] = {}

    def _ymd_hms(self, sec: int) -> str:
        text = self._seconds.get(sec)
        if text is None:
            if len(self._seconds) > 8192:  # progress is mostly forward: old seconds are dead weight
                self._seconds.clear()
            text = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(sec))
            self._seconds[sec] = text
        return text

    def py(self, t: float) -> str:
        """Python logging's default: ``2024-05-01 12:00:03,123``."""
        sec = int(t)
        return f"{self._ymd_hms(sec)},{int((t - sec) * 1000):03d}"

    def seconds(self, t: float) -> str:
        """Megatron's ``[2024-05-01 12:00:03]`` without the brackets."""
        return self._ymd_hms(int(t))

    def c10(self, t: float) -> str:
        """The C++ side of torch >= 2.4: ``501 12:00:03.123456789`` (month not zero-padded)."""
        st = time.gmtime(t)
        frac = int((t % 1) * 1e9)
        return f"{st.tm_mon}{st.tm_mday:02d} {st.tm_hour:02d}:{st.tm_min:02d}:{st.tm_sec:02d}.{frac:09d}"

    def glog(self, t: float) -> str:
        """torch.distributed.elastic's glog-style stamp (torch >= 2.4): ``0501 12:00:03.123000``."""
        st = time.gmtime(t)
        micros = int((t % 1) * 1000) * 1000  # Python's logging only has milliseconds
        return f"{st.tm_mon:02d}{st.tm_mday:02d} {st.tm_hour:02d}:{st.tm_min:02d}:{st.tm_sec:02d}.{micros:06d}"

    def dmesg(self, t: float) -> str:
        """``dmesg -T``: ``Wed May  1 12:00:03 2024``."""
        return time.strftime("%a %b %e %H:%M:%S %Y", time.gmtime(t))

    def syslog(self, t: float) -> str:
        """Classic syslog: ``May  1 12:00:03``."""
        return time.strftime("%b %e %H:%M:%S", time.gmtime(t))

    def iso(self, t: float) -> str:
        """Slurm: ``2024-05-01T12:00:03``."""
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t))

    def underscored(self, t: float) -> str:
        """torchrun's ChildFailedError summary: ``2024-05-01_12:00:03``."""
        return time.strftime("%Y-%m-%d_%H:%M:%S", time.gmtime(t))
