"""``grpo-stream bench learner``: learner step time split into transport (Kafka consume + decode + collate) and
compute (forward, backward, optimizer), for the tiny model and a ~50M-parameter model on CPU.

All groups are in the topic before the timed steps start, so the wait is pure consume+decode, not generation.
Target: the transport share < 3% of the step. Then what one checkpoint costs as the dedup window fills
(``checkpoint_cost``).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import cast

import numpy as np
import torch

from grpo_core import wire
from grpo_core.config import KafkaConfig, load_config
from grpo_core.kafka_io import DeadLetters, make_admin, make_consumer, make_producer
from grpo_learner.config import LearnerConfig
from grpo_learner.service import load_model
from grpo_learner.source import GroupSource, SourceRules
from grpo_learner.trainer import Trainer
from grpo_stream.bench import checkpoint_cost, temporary_broker
from grpo_stream.tiny_model import build_tiny_model

TARGET_SHARE = 0.03
CACHE = Path(".cache") / "bench-models"


def synthetic_group(gid: str, g: int, prompt_len: int, completion_len: int, vocab: int,
                    rng: np.random.Generator) -> wire.ScoredGroup:
    members = [wire.Completion(
        group_id=gid, index=i, group_size=g, prompt_id=gid, task="bench",
        prompt_token_ids=rng.integers(0, vocab, prompt_len, dtype=np.int32),
        completion_token_ids=rng.integers(0, vocab, completion_len, dtype=np.int32),
        behaviour_logprobs=-rng.exponential(5.0, completion_len).astype(np.float32),
        policy_version=0, producer_id="bench", finish_reason="length") for i in range(g)]
    rewards = [float(x) for x in rng.integers(0, 2, g)]
    return wire.ScoredGroup(group_id=gid, prompt_id=gid, task="bench", policy_version=0, completions=members,
                            rewards=rewards, reward_mean=float(np.mean(rewards)),
                            reward_std=float(np.std(rewards)), verifier_id="bench", group_size=g)


def measure(bootstrap: str, preset: str, steps: int, g: int, groups_per_batch: int, prompt_len: int,
            completion_len: int) -> dict[str, float]:
    model_dir = build_tiny_model(CACHE / preset, preset=preset)
    topic = f"bench-groups-{uuid.uuid4().hex[:8]}"
    kafka = KafkaConfig(bootstrap=bootstrap)
    admin = make_admin(kafka)
    admin.create_topics({topic: {"num_partitions": 4, "replication_factor": 1},
                         topic + "-dlq": {"num_partitions": 1, "replication_factor": 1}})
    admin.wait_for_topics([topic, topic + "-dlq"])
    producer = make_producer(kafka, "bench")
    rng = np.random.default_rng(0)
    for i in range((steps + 1) * groups_per_batch):
        group = synthetic_group(f"g{i}", g, prompt_len, completion_len, 300, rng)
        producer.send(topic, key=group.group_id.encode(), value=wire.encode(group))
    producer.flush()
    cfg = load_config(LearnerConfig, None, [f"model.path={model_dir}", f"pipeline.group_size={g}",
                                            f"groups_per_batch={groups_per_batch}", "pipeline.max_staleness=-1"])
    trainer = Trainer(cfg, load_model(cfg.model))
    source = GroupSource(make_consumer(kafka, "bench", None), topic, DeadLetters(producer, topic + "-dlq", "bench"),
                         SourceRules(g, True, -1, 0, False), 10_000)
    source.start(None, "earliest")
    totals = {"transport": 0.0, "compute": 0.0}
    for step in range(steps + 1):  # step 0 warms up (allocator, first fetch)
        pick = source.next_batch(step, groups_per_batch, lambda: False, 500)
        assert pick is not None  # None only once should_stop() is true
        # A trained item has its group (GroupSource._take).
        stats = trainer.train_step(cast(list[wire.ScoredGroup], [item.group for item in pick.trained]))
        if step == 0:
            continue
        totals["transport"] += pick.wait_s + stats.timings["collate"]
        totals["compute"] += sum(stats.timings[k] for k in ("forward_old", "forward", "backward", "optimizer"))
    source.consumer.close()
    producer.close()
    admin.delete_topics([topic, topic + "-dlq"])
    admin.close()
    params = sum(p.numel() for p in trainer.model.parameters())
    return {"params": params, **{k: v / steps for k, v in totals.items()}}


def main(bootstrap: str | None = None, steps: int = 5) -> int:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    shapes = {"tiny": (8, 4, 64, 128), "50m": (8, 4, 64, 128)}  # G, groups per step, prompt, completion tokens
    print(f"learner step split on {torch.get_num_threads()} CPU threads ({steps} timed steps after a warm-up):")
    with temporary_broker(bootstrap) as addr:
        for preset, (g, b, p_len, c_len) in shapes.items():
            t0 = time.perf_counter()
            r = measure(addr, preset, steps, g, b, p_len, c_len)
            share = r["transport"] / (r["transport"] + r["compute"])
            print(f"  {preset:>5} ({r['params'] / 1e6:5.1f}M params, {b}x{g} sequences of {p_len}+{c_len} tokens): "
                  f"transport {1000 * r['transport']:8.1f} ms  compute {1000 * r['compute']:9.1f} ms  "
                  f"share {100 * share:5.2f}% (target < {100 * TARGET_SHARE:.0f}%: "
                  f"{'OK' if share < TARGET_SHARE else 'ABOVE'})  [{time.perf_counter() - t0:.0f}s]")
    checkpoint_cost.report(build_tiny_model(CACHE / "tiny", preset="tiny"))
    return 0
