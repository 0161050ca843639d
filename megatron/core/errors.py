"""The root of every exception the package defines, and the families under it.

Catch :class:`MegatronError` for anything the package raises on purpose. Each class belongs
to one family, which says whose fault it is and what a caller can do about it:

* :class:`MegatronConfigError` — a configuration that cannot be used: flags, config
  dataclasses, parallel layouts, module specs, backend choices, server and engine options.
  Fix the settings and start again. A ``ValueError``.
* :class:`MegatronInputError` — a value handed to an API that it does not accept: a prompt,
  sampling parameters, a tensor of the wrong shape, a data or checkpoint file that is not what
  it should be, a call in a state that does not allow it. Fix the input. A ``ValueError``.
* :class:`MegatronRuntimeError` — a fault while running that no argument caused: a peer that
  left, fell silent or sent a malformed message, a closed client, a stopped coordinator, a
  failed transfer or checkpoint write, bytes that no longer match their checksum, a collective
  that did not complete. The same call may succeed later. A ``RuntimeError``, never a
  ``ValueError``.

Errors answered to a remote client keep their wire format: inference request errors
(:class:`megatron.core.inference.errors.InferenceRequestError`, each concrete one also a
``MegatronInputError`` or a ``MegatronRuntimeError``) and the HTTP server's ``APIError``.
"""

from __future__ import annotations


class MegatronError(Exception):
    """Base of every exception class defined under ``megatron``."""


class MegatronConfigError(MegatronError, ValueError):
    """Settings that cannot be used; the message names the fields or flags at fault and what is accepted."""


class MegatronInputError(MegatronError, ValueError):
    """A value or call an API does not accept; the message says what was wrong and what is accepted."""


class MegatronRuntimeError(MegatronError, RuntimeError):
    """A fault while running (a peer, a transfer, storage), not a bad argument; the message names it."""
