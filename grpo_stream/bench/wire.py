"""``grpo-stream bench wire``: msgpack encode/decode+validate throughput and loopback Kafka throughput.

The record is a realistic rollout: a ScoredGroup of G=16 sibling Completions, each with a 128-token prompt and
512 completion tokens with float32 behaviour logprobs. Target: decode+validate >= 200 MB/s on one core.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import numpy as np

from grpo_core import wire
from grpo_core.config import KafkaConfig
from grpo_stream.bench import temporary_broker

TARGET_DECODE_MB_S = 200.0


def make_completion(group_id: str, index: int, group_size: int = 16, tokens: int = 512, prompt_tokens: int = 128,
                    version: int = 0, rng: np.random.Generator | None = None) -> wire.Completion:
    rng = rng or np.random.default_rng(index)
    return wire.Completion(
        group_id=group_id, index=index, group_size=group_size, prompt_id=group_id.split("@")[0], task="math",
        prompt_token_ids=rng.integers(0, 150_000, prompt_tokens, dtype=np.int32),
        completion_token_ids=rng.integers(0, 150_000, tokens, dtype=np.int32),
        behaviour_logprobs=-rng.exponential(1.0, tokens).astype(np.float32),
        policy_version=version, producer_id="producer-0", finish_reason="stop",
        prompt="Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
               "How many clips did Natalia sell altogether in April and May?",
        completion="x" * 1500, metadata={"answer": "72"}, timings={"generate_s": 1.25, "queued_s": 0.01})


def make_group(group_id: str = "gsm8k-0001@e0r0", group_size: int = 16, tokens: int = 512,
               version: int = 0, seed: int = 0) -> wire.ScoredGroup:
    rng = np.random.default_rng(seed)
    members = [make_completion(group_id, i, group_size, tokens, version=version, rng=rng) for i in range(group_size)]
    rewards = [float(x) for x in rng.integers(0, 2, group_size)]
    return wire.ScoredGroup(
        group_id=group_id, prompt_id=group_id.split("@")[0], task="math", policy_version=version,
        completions=members, rewards=rewards, reward_mean=float(np.mean(rewards)),
        reward_std=float(np.sqrt(np.var(rewards) + 1e-4)), verifier_id="verifier-0", group_size=group_size)


def _rate(fn: Callable[[], object], seconds: float) -> float:
    """Calls per second of ``fn`` over about ``seconds`` of wall time."""
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or n < 5:
        fn()
        n += 1
    return n / elapsed


def codec_figures(seconds: float) -> list[tuple[str, float, float]]:
    """(name, MB/s, records/s) for encode and decode+validate of a Completion and a ScoredGroup."""
    group = make_group()
    rows = []
    for name, record in (("Completion", group.completions[0]), ("ScoredGroup(G=16)", group)):
        data = wire.encode(record)
        # (mypy cannot infer a lambda with a default argument: the ignores below)
        enc = _rate(lambda r=record: wire.encode(r), seconds)  # type: ignore[misc]
        kind = type(record)
        dec = _rate(lambda d=data, k=kind: wire.decode(d, k), seconds)  # type: ignore[misc]
        rows += [(f"encode {name} ({len(data)} B)", enc * len(data) / 1e6, enc),
                 (f"decode+validate {name} ({len(data)} B)", dec * len(data) / 1e6, dec)]
    return rows


def kafka_figures(bootstrap: str, records: int) -> tuple[float, float, float, float]:
    """Produce ``records`` ScoredGroups to a fresh topic and consume them back; (MB/s, rec/s) each way."""
    from grpo_core.kafka_io import make_admin, make_consumer, make_producer

    cfg = KafkaConfig(bootstrap=bootstrap)
    topic = f"bench-wire-{uuid.uuid4().hex[:8]}"
    admin = make_admin(cfg, "bench")
    admin.create_topics({topic: {"num_partitions": 4, "replication_factor": 1}})
    admin.wait_for_topics([topic])
    payloads = [wire.encode(make_group(f"g{i}@e0r0", seed=i)) for i in range(min(records, 64))]
    total = sum(len(payloads[i % len(payloads)]) for i in range(records))
    producer = make_producer(cfg, "bench")
    t0 = time.perf_counter()
    for i in range(records):
        producer.send(topic, key=f"g{i}".encode(), value=payloads[i % len(payloads)])
    producer.flush()
    produce_s = time.perf_counter() - t0
    consumer = make_consumer(cfg, "bench", group_id=None, topics=[topic])
    got, t0 = 0, time.perf_counter()
    while got < records and time.perf_counter() - t0 < 120:
        for batch in consumer.poll(timeout_ms=500).values():
            for msg in batch:
                wire.decode(msg.value, wire.ScoredGroup)
                got += 1
    consume_s = time.perf_counter() - t0
    producer.close()
    consumer.close()
    admin.delete_topics([topic])
    admin.close()
    if got != records:
        raise RuntimeError(f"consumed {got} of {records} records")
    return total / produce_s / 1e6, records / produce_s, total / consume_s / 1e6, records / consume_s


def main(seconds: float = 3.0, bootstrap: str | None = None, kafka_records: int = 2000) -> int:
    print("wire codec (one core, msgpack + numpy):")
    rows = codec_figures(seconds)
    for name, mb_s, rec_s in rows:
        print(f"  {name:<48} {mb_s:9.1f} MB/s {rec_s:11.0f} records/s")
    decode_group = rows[-1][1]
    print(f"  decode+validate ScoredGroup / target: {decode_group:.0f} / {TARGET_DECODE_MB_S:.0f} MB/s "
          f"= {decode_group / TARGET_DECODE_MB_S:.2f}x -> {'OK' if decode_group >= TARGET_DECODE_MB_S else 'BELOW'}")
    if kafka_records > 0:
        with temporary_broker(bootstrap) as addr:
            p_mb, p_rec, c_mb, c_rec = kafka_figures(addr, kafka_records)
        print(f"loopback Kafka ({kafka_records} ScoredGroups, lz4, acks=all, idempotent) at {addr}:")
        print(f"  produce             {p_mb:9.1f} MB/s {p_rec:11.0f} records/s")
        print(f"  consume+decode      {c_mb:9.1f} MB/s {c_rec:11.0f} records/s")
    return 0
