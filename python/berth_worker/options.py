"""Typed access to a load's ``KEY=VALUE`` options, with errors that name the
model, the option and what was expected (the Rust ``Options`` helper's
messages, word for word where they overlap)."""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING, Iterable, Optional

from .errors import BadRequest

if TYPE_CHECKING:
    from .spec import LoadSpec


class Options:
    """Typed view of :attr:`LoadSpec.options`.

    (Annotations say ``builtins.int`` and so on because the getters are
    named after the types they return.) Every getter raises :class:`~berth_worker.errors.BadRequest` (kind
    ``bad_request``: the operator's input is wrong, not the model) naming the
    model, the option and the value.
    """

    def __init__(self, spec: "LoadSpec") -> None:
        self.spec = spec

    def only(self, known: Iterable[builtins.str]) -> None:
        """Refuses options the backend does not know, so a typo is an error
        rather than a silently ignored setting."""
        known_set = sorted(set(known))
        unknown = [k for k in sorted(self.spec.options) if k not in known_set]
        if not unknown:
            return
        raise BadRequest(
            "model `{}`: backend `{}` has no option {} (it takes: {})".format(
                self.spec.name,
                self.spec.backend,
                ", ".join("`{}`".format(k) for k in unknown),
                ", ".join(known_set) if known_set else "none",
            )
        )

    def raw(self, key: builtins.str) -> Optional[builtins.str]:
        """The option's text as the operator wrote it, or ``None``."""
        return self.spec.options.get(key)

    def str(
        self, key: builtins.str, default: Optional[builtins.str] = None
    ) -> Optional[builtins.str]:
        """The option's text, or ``default`` when absent."""
        value = self.spec.options.get(key)
        return default if value is None else value

    def int(
        self, key: builtins.str, default: builtins.int, minimum: Optional[builtins.int] = None
    ) -> builtins.int:
        """The option as an integer (``default`` when absent); below
        ``minimum`` is refused."""
        raw = self.spec.options.get(key)
        if raw is None:
            return default
        text = raw.strip()
        try:
            if "_" in text:  # Python would take 1_000; the Rust worker does not
                raise ValueError(text)
            value = int(text, 10)
        except ValueError:
            raise self._invalid(key, raw, "integer") from None
        if minimum is not None and value < minimum:
            raise BadRequest(
                "model `{}`: option `{}={}` must be at least {} for backend `{}`".format(
                    self.spec.name, key, raw, minimum, self.spec.backend
                )
            )
        return value

    def float(self, key: builtins.str, default: builtins.float) -> builtins.float:
        """The option as a finite number (``default`` when absent)."""
        raw = self.spec.options.get(key)
        if raw is None:
            return default
        text = raw.strip()
        try:
            if "_" in text:
                raise ValueError(text)
            value = float(text)
        except ValueError:
            raise self._invalid(key, raw, "number") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise self._invalid(key, raw, "finite number")
        return value

    def bool(self, key: builtins.str, default: builtins.bool) -> builtins.bool:
        """The option as ``true`` or ``false`` (``default`` when absent)."""
        raw = self.spec.options.get(key)
        if raw is None:
            return default
        text = raw.strip()
        if text == "true":
            return True
        if text == "false":
            return False
        raise self._invalid(key, raw, "bool (`true` or `false`)")

    def _invalid(self, key: builtins.str, raw: builtins.str, what: builtins.str) -> BadRequest:
        return BadRequest(
            "model `{}`: option `{}={}` is not a valid {} for backend `{}`".format(
                self.spec.name, key, raw, what, self.spec.backend
            )
        )
