"""Receive-path patches for kafka-python 3.0, applied once per process by :mod:`grpo_core.kafka_io`: two
speedups and one fix.

kafka-python reads sockets 4 KiB per ``recv`` call and copies every buffered read twice. For the multi-MiB
records of the kafka weight store that is the bottleneck (``grpo-stream bench producer`` measures it), so the
consumer could not keep pace with a learner streaming a new version. The two speedups change nothing observable
but speed:

* ``KafkaTCPTransport._sock_recv`` drains the socket into one reusable 1 MiB buffer per connection (the same
  loop, exceptions and disconnect detection as the original, a 256x larger read per call);
* ``KafkaBytes.read`` copies once from a memoryview instead of slicing a bytearray and copying the slice.

The fix: ``KafkaTCPTransport._read_from_sock`` (TLS connections inherit it) dropped the bytes of a read that also
saw the peer close. A broker answers a refused SASL login and closes the connection after
``connection.failed.authentication.delay.ms`` (100 ms by default); a client busy for longer than that read the
answer and the close together, lost the answer, and took the refusal for an outage, retried with backoff: a
wrong password cost from a second to half a minute instead of failing at once. The patched loop hands the
bytes to the protocol first, then closes.

Each replaces a function whose source we checked. pyproject.toml pins kafka-python to the release they were
written for; any other release (or a changed function) is refused at start-up with :class:`UnpatchedKafkaError`,
so neither the speed-up nor the fix can vanish silently with an upgrade. ``GRPO_STREAM_UNPATCHED_KAFKA=1`` runs
anyway, unpatched (slower for large records, a refused login may be reported late), with a warning. TLS
connections keep kafka-python's own ``KafkaSSLTransport._sock_recv``.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

PINNED = "3.0.12"  # kafka-python's release the patches were written for (pyproject.toml pins it)
OVERRIDE_ENV = "GRPO_STREAM_UNPATCHED_KAFKA"


class UnpatchedKafkaError(RuntimeError):
    """The installed kafka-python is not the release the receive patches were written for."""

_RECV_BYTES = 1 << 20
# sha256 of the exact upstream source each patch replaces (kafka-python 3.0.12).
_EXPECTED = {
    "KafkaTCPTransport._sock_recv": "2594a6a62ec5a3e56355033514d33265dcd9513bc5c24342c1b91c90641589ff",
    "KafkaBytes.read": "21580870f9dff4aa732e1b80061bd6d11ccd122104d7e10c7c93962417a9a3a9",
    "KafkaTCPTransport._read_from_sock": "572fe643c70751bf28e4e977ce7fcc667ba473801a01cd642c85834ad2413af5",
}
_applied: dict[str, bool] = {}
_originals: dict[str, Any] = {}  # the upstream functions, kept to check them again


def _source_hash(fn: Any) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()


def _sock_recv(self: Any) -> tuple[bytes, Exception | None]:
    import kafka.errors as errors

    buf = getattr(self, "_grpo_recv_buf", None)
    if buf is None:
        buf = self._grpo_recv_buf = bytearray(_RECV_BYTES)
    view, received, err = memoryview(buf), [], None
    while True:
        try:
            n = self._sock.recv_into(buf)
        except (BlockingIOError, InterruptedError):
            break
        except BaseException as exc:  # as upstream: any other socket error closes the connection
            log.exception("%s: Error receiving network data closing socket", self)
            err = errors.KafkaConnectionError(exc)
            break
        if not n:
            err = errors.KafkaConnectionError("socket disconnected")
            break
        received.append(bytes(view[:n]))
    return (received[0] if len(received) == 1 else b"".join(received)), err


def _read(self: Any, nbytes: int | None = None) -> bytes:
    if nbytes is None:
        nbytes = len(self) - self._idx
    start = self._idx
    self._idx = min(self._idx + nbytes, len(self))
    return bytes(memoryview(self)[start:self._idx])


async def _read_from_sock(self: Any) -> None:
    import kafka.errors as errors

    while self._read and not self._closed:
        await self._net.wait_read(self._sock)
        received, err = self._sock_recv()
        if received:  # first: the last answer before a close (a refused login's) must reach the protocol
            self.last_read = time.monotonic()
            if self._protocol and self._protocol._sensors:
                self._protocol._sensors.bytes_received.record(len(received))
            try:
                self._protocol.data_received(received)
            except errors.KafkaProtocolError as exc:
                return self.abort(error=exc)
            if err:
                # The close is read again next time round (a closed socket stays readable and empty): by then
                # the loop has run the request the answer woke, so the connection fails with the answer's error.
                continue
        if err:
            return self.abort(error=err)
    return None


def apply() -> dict[str, bool]:
    """Patch the three functions; returns {name: applied}. Idempotent. Raises :class:`UnpatchedKafkaError` when the
    installed kafka-python is not the pinned release or a patched function changed, unless the override is set."""
    if _applied:
        return dict(_applied)
    import kafka
    from kafka.net.transport import KafkaTCPTransport
    from kafka.protocol.frame import KafkaBytes

    targets = {"KafkaTCPTransport._sock_recv": (KafkaTCPTransport, "_sock_recv", _sock_recv),
               "KafkaBytes.read": (KafkaBytes, "read", _read),
               "KafkaTCPTransport._read_from_sock": (KafkaTCPTransport, "_read_from_sock", _read_from_sock)}
    originals = {name: _originals.get(name, getattr(cls, attr)) for name, (cls, attr, _) in targets.items()}
    changed = [name for name, fn in originals.items() if _source_hash(fn) != _EXPECTED[name]]
    version = getattr(kafka, "__version__", "?")
    if version != PINNED or changed:
        refuse(version, changed)
        return dict.fromkeys(targets, False)
    for name, (cls, attr, replacement) in targets.items():
        _originals[name] = originals[name]
        setattr(cls, attr, replacement)
        _applied[name] = True
    return dict(_applied)


def refuse(version: str, changed: list[str]) -> None:
    """Raise, or with the override set only warn: the patches do not match the installed kafka-python."""
    what = f"kafka-python {version} is installed, but grpo-stream's receive patches were written for {PINNED}"
    if changed:
        what += f" (changed upstream: {', '.join(changed)})"
    if os.environ.get(OVERRIDE_ENV) == "1":
        log.warning("%s; running unpatched (%s=1): large records are received ~2x more slowly, and a refused "
                    "login may pass for an outage for a while",
                    what, OVERRIDE_ENV)
        return
    raise UnpatchedKafkaError(f"{what}. Install the pinned release (pip install kafka-python=={PINNED}), or set "
                              f"{OVERRIDE_ENV}=1 to run without the patches (slower weight transfers).")
