"""Link rates and tc sizes as text and numbers: '1gbit' <-> bits/s, '512kb' -> bytes."""

from __future__ import annotations

import re

_RATE_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
}
_SIZE_UNITS = {
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
}


def parse_rate(rate: str | float) -> int:
    """'1gbit', '300mbit', '100Mbit', 5e8 -> bits/s (tc's units; 'bps' means bytes/s, as in tc)."""
    if isinstance(rate, bool):
        raise ValueError(f"not a rate: {rate!r}")
    if isinstance(rate, (int, float)):
        value = float(rate)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", rate.lower())
        if not match or (match.group(2) or "bit") not in _RATE_UNITS:
            raise ValueError(f"not a rate: {rate!r} (examples: 1gbit, 300mbit, 100mbit)")
        value = float(match.group(1)) * _RATE_UNITS[match.group(2) or "bit"]
    if not value >= 8000:
        raise ValueError(f"rate {rate!r} is below 8kbit, which tbf cannot shape sensibly")
    return int(value)


def format_rate(bits_per_s: int) -> str:
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g}{unit}"
    return f"{bits_per_s}bit"


def parse_size(size: str | int) -> int:
    """'512kb', '1mb', 65536 -> bytes (tc's kb = KiB)."""
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    match = re.fullmatch(r"\s*([0-9]+)\s*([a-z]*)\s*", str(size).lower())
    if not match or (match.group(2) or "b") not in _SIZE_UNITS:
        raise ValueError(f"not a size: {size!r} (examples: 256kb, 1mb)")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2) or "b"]
