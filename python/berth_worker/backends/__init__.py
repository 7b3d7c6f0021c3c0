"""The test backends every Python worker can offer: ``echo``, ``hog`` and
``fault``, with the same options and behaviour as the Rust worker's (see
each module), so the supervisor's tests run against both."""

from __future__ import annotations

from typing import Dict, Type

from ..backend import Backend
from .echo import Echo
from .fault import Fault
from .hog import Hog

#: What ``python3 -m berth_worker`` serves.
BUILTIN: Dict[str, Type[Backend]] = {"echo": Echo, "hog": Hog, "fault": Fault}

__all__ = ["BUILTIN", "Echo", "Fault", "Hog"]
