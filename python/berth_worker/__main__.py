"""``python3 -m berth_worker``: a worker offering the test backends
``echo``, ``hog`` and ``fault``."""

from __future__ import annotations

from .backends import BUILTIN
from .serve import serve


def main() -> None:
    """Serves the test backends."""
    serve(BUILTIN)


if __name__ == "__main__":
    main()
