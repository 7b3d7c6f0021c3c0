"""The package's version and the wire version it speaks."""

from __future__ import annotations

__version__ = "0.1.0"

#: The highest version of docs/wire.md this package speaks.
WIRE_VERSION = 1
