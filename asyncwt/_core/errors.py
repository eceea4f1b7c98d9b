"""Every error asyncwt raises on purpose derives from `AsyncwtError`.

Hierarchy::

    AsyncwtError
    ├── PlanMismatchError      trainer and worker derived different transfer plans
    ├── RoundConflictError     a control call out of order, or for another round or trainer
    ├── SourceMismatchError    the weight source yielded something the plan did not expect
    ├── TransferError          the data plane failed
    │   ├── AuthenticationError    a peer failed the token challenge
    │   ├── ProtocolError          a frame header or handshake was malformed
    │   ├── TransferAbortedError   the peer aborted the round
    │   └── TransferTimeoutError   a wait on the peer ran past its timeout
    ├── ApplyError             background post-processing on the worker failed
    └── ControlPlaneError      an RPC to a worker failed (HTTP status, bad reply)

Bad arguments are `ValueError`/`TypeError`, as in the standard library: they are the
caller's bug, not a runtime condition of the transfer. One rule settles which: a
value that fails validation (a setting, an init or update info, a request body) is
a `ValueError` even when what is wrong is its type, because validation is one
kind of check and the worker server answers every `ValueError` with 400. A
`TypeError` is kept for a programming error in a call (an object of the wrong
class handed to an API). Ruff's TRY004 is off for this reason (pyproject.toml).
"""

from __future__ import annotations

__all__ = [
    "ApplyError",
    "AsyncwtError",
    "AuthenticationError",
    "ControlPlaneError",
    "PlanMismatchError",
    "ProtocolError",
    "RoundConflictError",
    "SourceMismatchError",
    "StaleRoundError",
    "TransferAbortedError",
    "TransferError",
    "TransferTimeoutError",
]


class AsyncwtError(Exception):
    """Root of every error asyncwt raises about a transfer."""


class PlanMismatchError(AsyncwtError, ValueError):
    """The two ends of a transfer derived different plans (metadata or wire parameters),
    or the trainer's plan does not fit the worker's model."""


class StaleRoundError(AsyncwtError, ValueError):
    """A round id that does not follow the last one: a replayed or reordered round."""


class RoundConflictError(AsyncwtError):
    """A control call the worker's round state refuses: out of order (a finish with no
    round open, an update before its start), for another round (a late update of an
    abandoned round), or from a trainer other than the one the worker was initialised
    with. The worker's state is unchanged."""


class SourceMismatchError(AsyncwtError):
    """A `WeightSource` yielded a name, dtype or shape other than the plan expected."""


class TransferError(AsyncwtError):
    """The data plane failed; the round did not complete."""


class AuthenticationError(TransferError):
    """A peer did not prove knowledge of the shared token."""


class ProtocolError(TransferError):
    """A peer sent a frame or handshake message that does not fit the protocol or plan."""


class TransferAbortedError(TransferError):
    """The peer aborted the round (its side failed or was cancelled).

    `buckets_received` counts the buckets this side had received whole when the
    abort arrived, between two buckets (`None` when unknown): with 0, not a byte of
    the round reached the model.
    """

    def __init__(self, message: str, *, buckets_received: int | None = None) -> None:
        super().__init__(message)
        self.buckets_received = buckets_received


class TransferTimeoutError(TransferError):
    """A wait on the peer ran past its configured timeout."""


class ApplyError(AsyncwtError):
    """Post-processing (unpack, transform, load) of a received parameter failed."""


class ControlPlaneError(AsyncwtError):
    """A control-plane call to a worker failed."""
