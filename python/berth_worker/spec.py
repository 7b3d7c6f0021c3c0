"""What the supervisor asks a worker to load: its own module, below both
:mod:`.backend` (which hands it to :meth:`Backend.load`) and :mod:`.options`
(which reads its options)."""

from __future__ import annotations

from typing import Dict, Optional

__all__ = ["LoadSpec"]


class LoadSpec:
    """What to load, as the supervisor's ``load`` message says it.

    ``name`` is the model's name in the supervisor (for messages),
    ``backend`` the backend to load, ``model`` a path or ``None``, and
    ``options`` the operator's ``KEY=VALUE`` options, all strings.
    """

    __slots__ = ("name", "backend", "model", "options")

    def __init__(
        self,
        name: str,
        backend: str,
        model: Optional[str] = None,
        options: Optional[Dict[str, str]] = None,
    ) -> None:
        self.name = name
        self.backend = backend
        self.model = model
        self.options: Dict[str, str] = dict(options or {})

    def __repr__(self) -> str:
        return "LoadSpec(name={!r}, backend={!r}, model={!r}, options={!r})".format(
            self.name, self.backend, self.model, self.options
        )
