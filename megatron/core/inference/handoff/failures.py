"""Typed, serializable errors of the KV state handoff.

Request-level failures subclass
:class:`~megatron.core.inference.errors.InferenceRequestError`, so they travel to the client as
the ``error`` of one terminal output (``to_dict`` / ``from_dict`` round-trip through msgpack and
JSON). A handoff the decode side cannot take is rejected (a ``ValueError``); a transfer that
cannot start or fails, a pull refused while storage is quarantined, and a prefill worker that
does not answer are runtime faults of the transport or a peer, not of the request. Settings the
handoff roles do not accept raise :class:`HandoffConfigError`.
"""

from __future__ import annotations

from megatron.core.errors import MegatronConfigError
from megatron.core.inference.errors import RequestFailedError, RequestRejectedError


class HandoffConfigError(MegatronConfigError):
    """A setting of a handoff role (timeouts, bounds) that is out of range (the message says which)."""


class HandoffRejectedError(RequestRejectedError):
    """The decode side cannot take this handoff (checked before it is queued); nothing was
    queued or transferred."""

    fields = ("request_id", "reason")

    def describe(self, request_id, reason):
        return f"handoff of request {request_id!r} rejected: {reason}"


class HandoffMetadataError(RequestRejectedError):
    """A handoff record that is malformed or does not match the decode side's model."""

    fields = ("request_id", "field", "problem")

    def describe(self, request_id, field, problem):
        return f"handoff record of request {request_id!r} has a bad {field!r}: {problem}"


class TransferSubmitError(RequestFailedError):
    """The transport refused to start a pull; nothing was transferred, so all storage of the
    import was released."""

    fields = ("request_id", "transport", "reason")

    def describe(self, request_id, transport, reason):
        return f"could not start the KV pull of request {request_id!r} over {transport}: {reason}"


class TransferFailedError(RequestFailedError):
    """A posted pull failed; the storage it may still write is quarantined, not reused."""

    fields = ("request_id", "transport", "reason")

    def describe(self, request_id, transport, reason):
        return f"KV pull of request {request_id!r} over {transport} failed: {reason}"


class QuarantineFullError(RequestFailedError):
    """The decode side refused a new pull: storage held back from transfers that have not ended
    (quarantined) is past its bound, or leaves too little room for this import. Nothing was
    pulled; the same request may succeed once those transfers end or their peers are gone."""

    fields = ("request_id", "reason")

    def describe(self, request_id, reason):
        return f"the decode engine refused to pull request {request_id!r}: {reason}"


class PrefillFailedError(RequestFailedError):
    """The prefill worker did not answer for a request in time, or could not be reached."""

    fields = ("request_id", "reason")

    def describe(self, request_id, reason):
        return f"prefill of request {request_id!r} failed: {reason}"
