"""``grpo-stream bench verifier``: scored groups/s for G=16 with the ``math`` reward (math-verify in the sandboxed
pool) and with a trivial reward (``exact``, inline), and the share of verifier time spent in Kafka + decode +
assembly versus reward computation versus publishing.

All completions are in the topic before the timed run starts, so the measurement is the verifier's own work.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np

from grpo_core import wire
from grpo_core.config import KafkaConfig, load_config
from grpo_core.contract import PipelineContract
from grpo_core.kafka_io import make_admin, make_producer
from grpo_core.topics import ensure_topics
from grpo_stream.bench import temporary_broker

G = 16
SOLUTION = ("Natalia sold 48/2 = 24 clips in May. Natalia sold 48+24 = 72 clips altogether in April and May. "
            "The answer is \\boxed{{{answer}}}.")


def completions(n_groups: int, task: str, rng: np.random.Generator) -> list[wire.Completion]:
    out = []
    for k in range(n_groups):
        gid = f"g{k}@e0r0"
        for i in range(G):
            right = rng.random() < 0.5
            text = SOLUTION.format(answer=72 if right else 71) if task == "math" else ("72" if right else "71")
            out.append(wire.Completion(
                group_id=gid, index=i, group_size=G, prompt_id=f"g{k}", task=task,
                prompt_token_ids=rng.integers(0, 150_000, 128, dtype=np.int32),
                completion_token_ids=rng.integers(0, 150_000, 256, dtype=np.int32),
                behaviour_logprobs=-rng.exponential(1.0, 256).astype(np.float32), policy_version=0,
                producer_id="bench", finish_reason="stop", prompt="How many clips did Natalia sell?",
                completion=text, metadata={"answer": "#### 72" if task == "math" else "72"}))
    return out


def measure(bootstrap: str, task: str, n_groups: int, workers: int) -> dict[str, float]:
    from grpo_verifiers.config import VerifierConfig
    from grpo_verifiers.service import Verifier

    run = f"bench-{uuid.uuid4().hex[:8]}"
    plan = PipelineContract(run=run)
    admin = make_admin(KafkaConfig(bootstrap=bootstrap))
    ensure_topics(admin, plan)
    producer = make_producer(KafkaConfig(bootstrap=bootstrap), "bench")
    for c in completions(n_groups, task, np.random.default_rng(0)):
        producer.send(plan.topic("completions"), key=c.group_id.encode(), value=wire.encode(c))
    producer.flush()
    producer.close()
    cfg = load_config(VerifierConfig, None, [
        f"kafka.bootstrap={bootstrap}", f"pipeline.run={run}", "metrics.port=-1", f"rewards.workers={workers}"])
    verifier = Verifier(cfg)
    verifier.pool.wait_ready(120)
    timings = _instrument(verifier)
    t0 = time.perf_counter()
    while verifier.metrics.groups.labels(task=task)._value.get() < n_groups and time.perf_counter() - t0 < 600:
        verifier.stopping = False
        _one_round(verifier)
    wall = time.perf_counter() - t0
    verifier.close()
    admin.delete_topics([s.name for s in plan.topic_plan()])
    admin.close()
    return {"groups_per_s": n_groups / wall, "wall": wall, **{k: v / wall for k, v in timings.items()}}


def _instrument(verifier: Any) -> dict[str, float]:
    """Wrap the verifier's phases with timers (the service itself stays free of benchmark code)."""
    timings = {"kafka+decode+assembly": 0.0, "rewards": 0.0, "publish+commit": 0.0}
    pool = verifier.pool
    score = pool.score_batch

    def timed_score(items: list) -> list:
        t = time.perf_counter()
        try:
            return score(items)
        finally:
            timings["rewards"] += time.perf_counter() - t

    pool.score_batch = timed_score
    verifier._timings = timings
    return timings


def _one_round(v: Any) -> None:
    """One iteration of Verifier.run with the phases timed."""
    t = time.perf_counter()
    polled = v.consumer.poll(timeout_ms=v.cfg.poll_timeout_ms, max_records=v.cfg.max_poll_records)
    ready = v._assemble(polled)
    v._timings["kafka+decode+assembly"] += time.perf_counter() - t
    if ready:
        t = time.perf_counter()
        rewards_before = v._timings["rewards"]
        v._score_and_publish(ready)
        v.commit()
        v._timings["publish+commit"] += time.perf_counter() - t - (v._timings["rewards"] - rewards_before)


def main(bootstrap: str | None = None, groups: int = 200, workers: int = 2) -> int:
    print(f"verifier: {groups} groups of G={G} (256-token completions) already in the topic; {workers} reward workers")
    with temporary_broker(bootstrap) as addr:
        for task, label in (("exact", "trivial reward (exact, inline)"), ("math", "math reward (math-verify, pool)")):
            r = measure(addr, task, groups, workers)
            shares = "  ".join(f"{k} {100 * r[k]:4.1f}%" for k in ("kafka+decode+assembly", "rewards",
                                                                    "publish+commit"))
            print(f"  {label:<34} {r['groups_per_s']:8.1f} groups/s  ({r['wall']:.1f}s)  time: {shares}")
    return 0
