"""Byte quantities at the edges: parse "80GiB"/"24GB", print with explicit units.

Inside vramplan every size is an ``int`` of bytes. GiB means 2**30 and GB means 10**9;
output always names which one it uses.
"""

from __future__ import annotations

import re

from .errors import VramplanError

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4
KB = 1000
MB = 1000**2
GB = 1000**3
TB = 1000**4

_UNITS = {
    "": 1, "b": 1,
    "k": KiB, "kib": KiB, "kb": KB,
    "m": MiB, "mib": MiB, "mb": MB,
    "g": GiB, "gib": GiB, "gb": GB,
    "t": TiB, "tib": TiB, "tb": TB,
}
_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float) -> int:
    """Parse ``"80GiB"``, ``"24 GB"``, ``"512MiB"``, ``"1.5g"`` or a number of bytes.

    Single-letter suffixes (k, m, g, t) are binary, as in ``PYTORCH_CUDA_ALLOC_CONF``.
    """
    if isinstance(text, bool):
        raise VramplanError(f"invalid size {text!r}", hint="write e.g. 80GiB or 24GB")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        m = _RE.match(text)
        if not m or m.group(2).lower() not in _UNITS:
            raise VramplanError(f"invalid size {text!r}", hint="write e.g. 80GiB, 24GB or 512MiB")
        value, unit = float(m.group(1)), m.group(2).lower()
    if value < 0:
        raise VramplanError(f"invalid size {text!r}: must not be negative")
    return int(round(value * _UNITS[unit]))


def gib(n: int | float) -> float:
    return n / GiB


def fmt_bytes(n: int | float, unit: str = "GiB", digits: int = 2) -> str:
    """Format bytes in an explicit unit (``GiB`` by default, or ``auto`` for binary scaling)."""
    if unit == "auto":
        a = abs(n)
        for u, s in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
            if a >= s:
                return f"{n / s:,.{digits}f} {u}"
        return f"{int(n):,} B"
    scale = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB, "KB": KB, "MB": MB, "GB": GB, "TB": TB}[unit]
    return f"{n / scale:,.{digits}f} {unit}"
