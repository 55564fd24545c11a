"""The kafka-python receive patches behave exactly like the code they replace (only faster)."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import kafka.errors as errors
import pytest
from kafka.net.transport import KafkaTCPTransport
from kafka.protocol.frame import KafkaBytes

from grpo_core import kafka_io, kafka_patches  # noqa: F401  (kafka_io applies the patches on import)


def test_both_patches_are_applied_to_the_pinned_kafka_python() -> None:
    assert kafka_patches.apply() == {"KafkaTCPTransport._sock_recv": True, "KafkaBytes.read": True}
    assert KafkaTCPTransport._sock_recv is kafka_patches._sock_recv
    assert KafkaBytes.read is kafka_patches._read


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
    assert kafka_patches.apply() == {"KafkaTCPTransport._sock_recv": False, "KafkaBytes.read": False}


def test_a_changed_upstream_function_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka_patches, "_applied", {})
    monkeypatch.setitem(kafka_patches._EXPECTED, "KafkaBytes.read", "0" * 64)
    monkeypatch.delenv(kafka_patches.OVERRIDE_ENV, raising=False)
    with pytest.raises(kafka_patches.UnpatchedKafkaError, match="changed upstream: KafkaBytes.read"):
        kafka_patches.apply()
