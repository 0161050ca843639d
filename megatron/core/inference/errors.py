"""Errors of one inference request, answered to the client that sent it.

They travel from the engine (or the coordinator, or the handoff path) to the client inside the
request's terminal output, so they serialize to plain dicts that msgpack and JSON carry:
``{"type": class name, "message": str, "details": {field: value}}``
(:meth:`InferenceRequestError.to_dict`), and are rebuilt as the same type with the same message
(:meth:`InferenceRequestError.from_dict`).

Two branches, by whose fault it is:

* :class:`RequestRejectedError` — the request itself can never be served as sent (too long, a
  duplicate id, a handoff record that does not fit); nothing of it was kept. A
  :class:`~megatron.core.errors.MegatronInputError` (a ``ValueError``).
* :class:`RequestFailedError` — serving a valid request failed at run time (a KV transfer could
  not start or failed). A :class:`~megatron.core.errors.MegatronRuntimeError`.

The admission errors live next to what checks them (``contexts.errors``, ``engines.errors``,
``handoff.failures``); :class:`DuplicateRequestIdError` lives here because the coordinator, the
client, the engine and the handoff front end all raise it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from megatron.core.errors import MegatronError, MegatronInputError, MegatronRuntimeError


class InferenceRequestError(MegatronError):
    """A request error that a client receives; serializable, rebuilt by :meth:`from_dict`.

    Concrete subclasses derive from :class:`RequestRejectedError` or :class:`RequestFailedError`,
    declare their detail fields in ``fields`` and build the message from them in
    :meth:`describe`, so a round trip through :meth:`to_dict` gives an equal error.
    """

    fields: ClassVar[tuple[str, ...]] = ()
    _registry: ClassVar[dict[str, type[InferenceRequestError]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "describe" in cls.__dict__:  # the two branches are not wire types of their own
            InferenceRequestError._registry[cls.__name__] = cls

    def __init__(self, **details: Any):
        missing = [name for name in self.fields if name not in details]
        unknown = [name for name in details if name not in self.fields]
        if missing or unknown:
            raise TypeError(
                f"{type(self).__name__} takes exactly the fields {list(self.fields)}; "
                f"missing {missing}, unknown {unknown}"
            )
        self.details = details
        super().__init__(self.describe(**details))

    def describe(self, **details: Any) -> str:  # pragma: no cover - every concrete subclass overrides
        raise NotImplementedError

    @property
    def message(self) -> str:
        return str(self)

    def to_dict(self) -> dict[str, Any]:
        """``{"type": class name, "message": str, "details": {field: value}}`` (plain values only)."""
        return {"type": type(self).__name__, "message": str(self), "details": dict(self.details)}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> InferenceRequestError:
        """Rebuild the error :meth:`to_dict` described; unknown types raise ``ValueError``."""
        cls = InferenceRequestError._registry.get(data.get("type"))
        if cls is None:
            raise ValueError(
                f"unknown inference request error type {data.get('type')!r}; "
                f"known: {sorted(InferenceRequestError._registry)}"
            )
        return cls(**data["details"])

    def __eq__(self, other):
        return type(other) is type(self) and other.details == self.details

    def __hash__(self):
        return hash((type(self).__name__, tuple(sorted(self.details.items()))))

    def __reduce__(self):
        return (InferenceRequestError.from_dict, (self.to_dict(),))


class RequestRejectedError(InferenceRequestError, MegatronInputError):
    """The request cannot be served as sent (checked before it runs); nothing of it was kept."""


class RequestFailedError(InferenceRequestError, MegatronRuntimeError):
    """Serving the request failed at run time; the request itself may have been fine."""


class DuplicateRequestIdError(RequestRejectedError):
    """A request id that is already in flight (in the engine, the coordinator or the client)."""

    fields = ("request_id",)

    def describe(self, request_id):
        return f"request id {request_id!r} is already in use by an unfinished request; use a fresh id"
