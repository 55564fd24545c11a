"""The kafka-python receive patches: the speedups behave exactly like the code they replace (only faster); the
fix hands the last answer before a close to the protocol, where upstream dropped it."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import kafka.errors as errors
import pytest
from kafka.net.transport import KafkaTCPTransport
from kafka.protocol.frame import KafkaBytes

from grpo_core import kafka_io, kafka_patches  # noqa: F401  (kafka_io applies the patches on import)


def test_every_patch_is_applied_to_the_pinned_kafka_python() -> None:
    assert kafka_patches.apply() == {"KafkaTCPTransport._sock_recv": True, "KafkaBytes.read": True,
                                     "KafkaTCPTransport._read_from_sock": True}
    assert KafkaTCPTransport._sock_recv is kafka_patches._sock_recv
    assert KafkaBytes.read is kafka_patches._read
    assert KafkaTCPTransport._read_from_sock is kafka_patches._read_from_sock


def _read_until_closed(read_from_sock: object) -> list[object]:
    """Run a transport's read loop over a socket whose peer sent an answer and closed before the first read
    (what a broker refusing a login does); what reached the protocol and the abort, in order."""
    a, b = socket.socketpair()
    a.setblocking(False)
    b.sendall(b"answer")
    b.close()
    events: list[object] = []

    class Net:
        async def wait_read(self, sock: socket.socket) -> None:
            events.append("wait")

    transport = SimpleNamespace(_sock=a, _net=Net(), _read=True, _closed=False, last_read=0.0,
                                _protocol=SimpleNamespace(_sensors=None, data_received=lambda d: events.append(d)))
    transport._sock_recv = lambda: kafka_patches._sock_recv(transport)
    transport.abort = lambda error=None: events.append(type(error).__name__)
    try:
        asyncio.run(read_from_sock(transport))  # type: ignore[operator]
    finally:
        a.close()
    return events


def test_the_answer_read_with_the_close_reaches_the_protocol_before_the_abort() -> None:
    # Upstream loses it: a refused login then looks like an outage and is retried (tests/test_security.py).
    assert _read_until_closed(kafka_patches._originals["KafkaTCPTransport._read_from_sock"]) == [
        "wait", "KafkaConnectionError"]
    # Patched: the answer first; the close is read again a turn later, after the request it woke has run.
    assert _read_until_closed(kafka_patches._read_from_sock) == [
        "wait", b"answer", "wait", "KafkaConnectionError"]


@pytest.mark.parametrize("reads", [[None], [3, 4, None], [0, 10, 100, 5], [15, 1]])
def test_buffer_reads_match_the_original_semantics(reads: list[int | None]) -> None:
    payload = bytes(range(15))
    buf = KafkaBytes(len(payload))
    buf.write(payload)
    buf.seek(0)
    pos = 0
    for n in reads:
        want = payload[pos:] if n is None else payload[pos:pos + n]
        got = buf.read(n)
        assert got == want and type(got) is bytes
        pos = min(len(payload), pos + (len(payload) if n is None else n))
        assert buf.tell() == pos


def test_socket_receive_drains_everything_then_reports_a_close() -> None:
    a, b = socket.socketpair()
    a.setblocking(False)
    transport = SimpleNamespace(_sock=a)
    try:
        assert kafka_patches._sock_recv(transport) == (b"", None)  # nothing there yet: not an error
        payload = bytes(range(256)) * 12_000  # ~3 MiB: several 1 MiB reads
        b.setblocking(True)
        sent, seen = 0, b""
        while len(seen) < len(payload):  # interleaved: a socketpair buffers far less than the payload
            if sent < len(payload):
                sent += b.send(payload[sent:sent + 65536])
            got, err = kafka_patches._sock_recv(transport)
            assert err is None
            seen += got
        assert seen == payload
        b.close()
        got, err = kafka_patches._sock_recv(transport)
        assert got == b"" and isinstance(err, errors.KafkaConnectionError)
    finally:
        a.close()


def test_another_kafka_python_release_is_refused_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    """An upgrade must not drop the speed-up silently: another release stops the process with what to do."""
    import kafka

    monkeypatch.setattr(kafka_patches, "_applied", {})
    monkeypatch.setattr(kafka, "__version__", "3.1.0")
    monkeypatch.delenv(kafka_patches.OVERRIDE_ENV, raising=False)
    with pytest.raises(kafka_patches.UnpatchedKafkaError, match=r"kafka-python 3.1.0 is installed.*3.0.12.*pip inst"):
        kafka_patches.apply()
    monkeypatch.setenv(kafka_patches.OVERRIDE_ENV, "1")  # the deliberate way to run unpatched
    assert kafka_patches.apply() == {"KafkaTCPTransport._sock_recv": False, "KafkaBytes.read": False,
                                     "KafkaTCPTransport._read_from_sock": False}


def test_a_changed_upstream_function_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka_patches, "_applied", {})
    monkeypatch.setitem(kafka_patches._EXPECTED, "KafkaBytes.read", "0" * 64)
    monkeypatch.delenv(kafka_patches.OVERRIDE_ENV, raising=False)
    with pytest.raises(kafka_patches.UnpatchedKafkaError, match="changed upstream: KafkaBytes.read"):
        kafka_patches.apply()
