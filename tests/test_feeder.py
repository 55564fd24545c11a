"""The feeder: datasets -> PromptTasks on the prompts topic, epochs, seeded order, resume, rate limit, backpressure."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from kafka import TopicPartition
from kafka.structs import OffsetAndMetadata

from grpo_core import wire
from grpo_core.config import ConfigError, KafkaConfig, load_config
from grpo_core.kafka_io import make_consumer
from grpo_producers import datasets
from grpo_producers.datasets import SyntheticConfig, load_synthetic, stable_id, synthetic_eval_ids
from grpo_producers.feeder import BadItems, Feeder, FeederConfig, FeederMetrics, load_items

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = [f"What is {i} + {i}?" for i in range(8)]


def write_jsonl(path: Path) -> Path:
    """10 lines: 8 good GSM8K-style rows, one invalid JSON, one without a prompt."""
    lines = [json.dumps({"question": q, "answer": f"#### {2 * i}", "level": i}) for i, q in enumerate(QUESTIONS)]
    lines.insert(3, '{"question": "broken", ')
    lines.insert(7, json.dumps({"answer": "5"}))
    path.write_text("\n".join(lines) + "\n")
    return path


def feeder_cfg(kafka_cfg: KafkaConfig, topic: str, tmp_path: Path, *overrides: str) -> FeederConfig:
    base = [f"kafka.bootstrap={kafka_cfg.resolved_bootstrap()}", "pipeline.prefix=''",
            f"pipeline.topics.prompts.name={topic}", "name=ds", f"state_path={tmp_path / 'state.json'}",
            "metrics.port=-1"]
    if not any(o.startswith("source=") for o in overrides):
        base += [f"jsonl.paths=[{write_jsonl(tmp_path / 'data.jsonl')}]", "jsonl.metadata_fields=[level]"]
    return load_config(FeederConfig, None, [*base, *overrides])


def read_all(kafka_cfg: KafkaConfig, topic: str) -> list[tuple[str, wire.PromptTask]]:
    """Every record of ``topic`` (partition by partition, in offset order) as (key, decoded task)."""
    consumer = make_consumer(kafka_cfg, "test-reader", None)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        out: dict[int, list[tuple[str, wire.PromptTask]]] = {tp.partition: [] for tp in tps}
        deadline = time.monotonic() + 30
        while any(consumer.position(tp) < ends[tp] for tp in tps) and time.monotonic() < deadline:
            for tp, msgs in consumer.poll(timeout_ms=500).items():
                out[tp.partition] += [(m.key.decode(), wire.decode(m.value, wire.PromptTask)) for m in msgs]
        return [rec for p in sorted(out) for rec in out[p]]
    finally:
        consumer.close()


def run_feeder(cfg: FeederConfig) -> Feeder:
    feeder = Feeder(cfg)
    try:
        feeder.run()
    finally:
        feeder.close()
    return feeder


def saved_state(cfg: FeederConfig) -> dict:
    return json.loads(cfg.resolved_state_path().read_text())


# ------------------------------------------------------------------------------------------ jsonl


def test_jsonl_two_epochs_seeded_order(kafka_cfg: KafkaConfig, new_topic: Callable[..., str],
                                       tmp_path: Path) -> None:
    topic = new_topic("prompts", 1)
    cfg = feeder_cfg(kafka_cfg, topic, tmp_path, "epochs=2", "seed=7", "flush_every=5")
    feeder = run_feeder(cfg)

    records = read_all(kafka_cfg, topic)
    assert len(records) == 16
    ids = {stable_id("ds", q): i for i, q in enumerate(QUESTIONS)}
    for key, task in records:
        assert key == task.prompt_id and task.prompt_id in ids
        i = ids[task.prompt_id]
        assert task.prompt == QUESTIONS[i] and task.task == "math" and task.sample_round == 0
        assert task.metadata == {"answer": f"#### {2 * i}", "level": i}
    by_epoch = [[t.prompt_id for _, t in records if t.epoch == e] for e in (0, 1)]
    assert [sorted(ids_) for ids_ in by_epoch] == [sorted(ids), sorted(ids)]  # each prompt once per epoch
    assert by_epoch[0] != by_epoch[1]  # reshuffled per epoch
    reg = feeder.metrics.registry
    assert reg.get_sample_value("grpo_stream_feeder_bad_items_total", {"reason": "invalid_json"}) == 1
    assert reg.get_sample_value("grpo_stream_feeder_bad_items_total", {"reason": "missing_prompt"}) == 1
    assert reg.get_sample_value("grpo_stream_feeder_prompts_published_total") == 16
    assert saved_state(cfg)["epoch"] == 2 and saved_state(cfg)["position"] == 0

    # Same seed, fresh state: the identical sequence. Another seed: another order.
    again = new_topic("prompts", 1)
    run_feeder(feeder_cfg(kafka_cfg, again, tmp_path, "epochs=2", "seed=7", "resume=false"))
    assert [t.group_id for _, t in read_all(kafka_cfg, again)] == [t.group_id for _, t in records]
    other = new_topic("prompts", 1)
    run_feeder(feeder_cfg(kafka_cfg, other, tmp_path, "epochs=2", "seed=8", "resume=false"))
    assert [t.group_id for _, t in read_all(kafka_cfg, other)] != [t.group_id for _, t in records]


def test_sample_rounds_make_distinct_groups(kafka_cfg: KafkaConfig, new_topic: Callable[..., str],
                                            tmp_path: Path) -> None:
    topic = new_topic("prompts", 2)
    run_feeder(feeder_cfg(kafka_cfg, topic, tmp_path, "sample_rounds=3"))
    groups = Counter(t.group_id for _, t in read_all(kafka_cfg, topic))
    assert len(groups) == 24 and set(groups.values()) == {1}
    assert {g.rsplit("@", 1)[1] for g in groups} == {"e0r0", "e0r1", "e0r2"}


def test_bad_rows_are_counted_not_fatal(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    rows = [b'{"prompt": "ok", "answer": 1}', b"\xff\xfe not utf-8", b"[1, 2]", b'{"prompt": "no answer"}',
            b'{"prompt": "ok", "answer": 2}', b'{"prompt": "' + b"x" * 50 + b'", "answer": 3}',
            b'{"prompt": "nested", "answer": {"a": 1}}', b"", b'{"prompt": "fine", "answer": [4, "4.0"]}']
    path.write_bytes(b"\n".join(rows))
    cfg = load_config(FeederConfig, None, [f"jsonl.paths=[{path}]", "max_prompt_chars=20", "jsonl.task=exact"])
    bad = BadItems(FeederMetrics())
    items = load_items(cfg, bad)
    assert [(it.prompt, it.metadata["answer"]) for it in items] == [("ok", "1"), ("fine", ["4", "4.0"])]
    assert all(it.task == "exact" for it in items)
    assert bad.counts == {"invalid_utf8": 1, "not_an_object": 1, "missing_answer": 1, "duplicate_id": 1,
                          "too_long": 1, "bad_metadata": 1}


def test_id_field_and_missing_files(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": 17, "prompt": "p"}\n{"prompt": "q"}\n')
    cfg = load_config(FeederConfig, None, [f"jsonl.paths=[{tmp_path}/*.jsonl]", "jsonl.id_field=id",
                                           "jsonl.answer_field=null"])
    bad = BadItems(FeederMetrics())
    assert [(it.prompt_id, it.metadata) for it in load_items(cfg, bad)] == [("17", {})]
    assert bad.counts == {"missing_id": 1}
    with pytest.raises(ConfigError, match="does not exist"):
        load_items(load_config(FeederConfig, None, [f"jsonl.paths=[{tmp_path}/nope.jsonl]"]), bad)


# ------------------------------------------------------------------------------------------ resume


def test_clean_stop_then_resume_publishes_each_group_once(kafka_cfg: KafkaConfig, new_topic: Callable[..., str],
                                                          tmp_path: Path) -> None:
    topic = new_topic("prompts", 1)
    run_feeder(feeder_cfg(kafka_cfg, topic, tmp_path, "epochs=2", "flush_every=3", "max_records=11"))
    assert (saved_state(feeder_cfg(kafka_cfg, topic, tmp_path))["epoch"],
            saved_state(feeder_cfg(kafka_cfg, topic, tmp_path))["position"]) == (1, 3)  # crossed the epoch
    assert len(read_all(kafka_cfg, topic)) == 11
    resumed = run_feeder(feeder_cfg(kafka_cfg, topic, tmp_path, "epochs=2", "flush_every=3"))
    assert resumed.sent == 5
    groups = Counter(t.group_id for _, t in read_all(kafka_cfg, topic))
    assert len(groups) == 16 and set(groups.values()) == {1}
    # Already done: a third run publishes nothing.
    assert run_feeder(feeder_cfg(kafka_cfg, topic, tmp_path, "epochs=2")).sent == 0


def test_crash_repeats_only_the_unsaved_tail(kafka_cfg: KafkaConfig, new_topic: Callable[..., str],
                                             tmp_path: Path) -> None:
    topic = new_topic("prompts", 1)
    cfg = feeder_cfg(kafka_cfg, topic, tmp_path, "epochs=2", "flush_every=4")
    feeder = Feeder(cfg)
    real_send, calls = feeder.producer.send, []

    def crashing_send(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) > 10:
            raise RuntimeError("simulated crash")
        return real_send(*args, **kwargs)

    feeder.producer.send = crashing_send  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="simulated crash"):
        feeder.run()
    feeder.close()  # a dying process's producer may still deliver the unsaved records: the worst case
    saved = saved_state(cfg)["position"]
    assert saved == 8  # the last checkpoint, taken after the broker acknowledged records 0..7
    first = [t.group_id for _, t in read_all(kafka_cfg, topic)]
    assert len(first) == 10

    run_feeder(cfg)
    groups = Counter(t.group_id for _, t in read_all(kafka_cfg, topic))
    assert len(groups) == 16  # none lost
    assert {g for g, n in groups.items() if n > 1} == set(first[saved:])  # repeats: only the unsaved tail
    assert all(groups[g] == 1 for g in first[:saved])  # no acknowledged, saved record re-published


def test_sigterm_saves_exact_progress(kafka_cfg: KafkaConfig, new_topic: Callable[..., str], tmp_path: Path) -> None:
    topic = new_topic("prompts", 2)
    overrides = [f"kafka.bootstrap={kafka_cfg.resolved_bootstrap()}", "pipeline.prefix=''",
                 f"pipeline.topics.prompts.name={topic}",
                 "source=synthetic", "synthetic.tasks=[add_small]", "synthetic.split=all", "epochs=0",
                 "rate_limit_per_s=40", "flush_every=1000", f"state_path={tmp_path / 'state.json'}", "metrics.port=0"]
    code = "import sys; from grpo_producers.feeder import main; sys.exit(main(None, sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, *overrides], cwd=REPO, env=os.environ.copy(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            n = len(read_all(kafka_cfg, topic))
            if n >= 10:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out.decode()[-3000:]
    state = json.loads((tmp_path / "state.json").read_text())
    records = read_all(kafka_cfg, topic)
    assert state["published_total"] == len(records) >= 10  # flush_every=1000: only the stop saved the state
    assert state["epoch"] * 25 + state["position"] == len(records)
    assert len({t.group_id for _, t in records}) == len(records)


# ------------------------------------------------------------------------------------------ pacing, backpressure


def test_rate_limit_lower_bound(kafka_cfg: KafkaConfig, new_topic: Callable[..., str], tmp_path: Path) -> None:
    topic = new_topic("prompts", 1)
    cfg = feeder_cfg(kafka_cfg, topic, tmp_path, "source=synthetic", "synthetic.tasks=[add_small]",
                     "synthetic.split=all", "rate_limit_per_s=50")
    feeder = Feeder(cfg)
    try:
        t0 = time.monotonic()
        assert feeder.run() == 25
        assert time.monotonic() - t0 >= 0.4  # 24 gaps of 20 ms; never assert an upper bound on timing
    finally:
        feeder.close()


def test_max_ahead_pauses_until_producers_consume(kafka_cfg: KafkaConfig, new_topic: Callable[..., str],
                                                  unique: Callable[[str], str], tmp_path: Path) -> None:
    topic, group = new_topic("prompts", 1), unique("producers")
    cfg = feeder_cfg(kafka_cfg, topic, tmp_path, "max_ahead=3", "flush_every=1", "lag_poll_s=0.05",
                     f"pipeline.groups.producers={group}")
    feeder = Feeder(cfg)
    thread = threading.Thread(target=feeder.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60  # the first lag query may wait for the group coordinator
        while len(read_all(kafka_cfg, topic)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        assert len(read_all(kafka_cfg, topic)) == 3 and thread.is_alive()  # paused: 3 unconsumed prompts
        consumer = make_consumer(kafka_cfg, "test-fake-producer", group)
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        try:
            while thread.is_alive():  # a "producer" that consumes everything as it arrives
                consumer.commit({tp: OffsetAndMetadata(consumer.end_offsets([tp])[tp], "", -1)})
                thread.join(0.1)
        finally:
            consumer.close()
    finally:
        feeder.stop()
        thread.join(30)
        feeder.close()
    assert len(read_all(kafka_cfg, topic)) == 8


# ------------------------------------------------------------------------------------------ synthetic


def _solve(prompt: str) -> str:
    if m := re.fullmatch(r"max\((\d),(\d)\)=", prompt):
        return str(max(int(m[1]), int(m[2])))
    if m := re.fullmatch(r"min\((\d),(\d)\)=", prompt):
        return str(min(int(m[1]), int(m[2])))
    if m := re.fullmatch(r"([0-4])\+([0-4])=", prompt):
        return str(int(m[1]) + int(m[2]))
    if m := re.fullmatch(r"last\((\d+)\)=", prompt):
        return m[1][-1]
    raise AssertionError(f"unexpected prompt {prompt!r}")


def synthetic(**kw: object) -> list[datasets.DatasetItem]:
    return list(load_synthetic(SyntheticConfig(**kw), "ignored", lambda r, w: None))  # type: ignore[arg-type]


def test_synthetic_tasks_are_correct_deterministic_and_split() -> None:
    tasks = ["max", "min", "add_small", "last_digit"]
    every = synthetic(tasks=tasks, split="all")
    assert len(every) == 100 + 100 + 25 + 990 == len({it.prompt_id for it in every})
    for it in every:
        assert it.task == "exact" and it.metadata["answer"] == _solve(it.prompt)
    train, evals = synthetic(tasks=tasks, split="train"), synthetic(tasks=tasks, split="eval")
    assert train == synthetic(tasks=tasks, split="train")  # deterministic
    train_ids, eval_ids = {it.prompt_id for it in train}, {it.prompt_id for it in evals}
    assert not train_ids & eval_ids and train_ids | eval_ids == {it.prompt_id for it in every}
    assert len(eval_ids) == 20 + 20 + 5 + 198  # exactly eval_fraction=0.2 of each family
    other = {it.prompt_id for it in synthetic(tasks=tasks, split="eval", seed=1)}
    assert other != eval_ids and len(other) == len(eval_ids)  # the seed picks the partition, not its size
    assert eval_ids == set().union(*(synthetic_eval_ids(f, SyntheticConfig()) for f in tasks))
    subset = synthetic(tasks=["last_digit"], num_items=50)
    assert len(subset) == 50 and subset == synthetic(tasks=["last_digit"], num_items=50)
    assert {it.prompt_id for it in subset} <= {it.prompt_id for it in synthetic(tasks=["last_digit"])}


def test_the_multi_token_families_copy_and_reverse_digits() -> None:
    for family, solve in (("copy", lambda d: d), ("reverse", lambda d: d[::-1])):
        items = synthetic(tasks=[family], split="all")
        assert len(items) == 10 + 100 * 7 == len({it.prompt_id for it in items})
        lengths = Counter(len(it.metadata["answer"]) for it in items)
        assert lengths == {1: 10, **{n: 100 for n in range(2, 9)}}  # 1-8 digits: 2-9 tokens with EOS
        for it in items:
            digits = it.prompt[it.prompt.index("(") + 1:it.prompt.index(")")]
            assert it.task == "positions" and it.metadata["answer"] == solve(digits)
        assert items == synthetic(tasks=[family], split="all")
        assert len(synthetic(tasks=[family], split="eval")) == 142
    short = synthetic(tasks=["copy_short"], split="all")
    assert Counter(len(it.metadata["answer"]) for it in short) == {1: 10, 2: 100, 3: 100, 4: 100}  # 2-5 tokens
    assert all(it.task == "positions" and it.prompt == f"copy({it.metadata['answer']})=" for it in short)
    # the same digit strings as copy's first four lengths, under ids of their own
    assert {it.prompt for it in short} == {it.prompt for it in synthetic(tasks=["copy"], split="all")
                                           if len(it.metadata["answer"]) <= 4}
    assert len(synthetic(tasks=["copy_short"], split="eval")) == 62


# ------------------------------------------------------------------------------------------ config, hf


def test_shipped_config_and_validation(tmp_path: Path) -> None:
    cfg = load_config(FeederConfig, REPO / "configs/feeder.yaml")
    assert cfg.source == "jsonl" and cfg.jsonl.prompt_field == "question" and cfg.jsonl.answer_field == "answer"
    with pytest.raises(ConfigError, match="forever"):
        load_config(FeederConfig, None, ["source=synthetic", "epochs=0"])
    with pytest.raises(ConfigError, match="jsonl.paths"):
        load_config(FeederConfig, None, [])
    with pytest.raises(ConfigError, match="synthetic.tasks"):
        load_config(FeederConfig, None, ["source=synthetic", "synthetic.tasks=[nope]"])


def test_state_from_another_schedule_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "s.json"
    base = ["source=synthetic", f"state_path={state}", "kafka.bootstrap=127.0.0.1:1"]
    items = load_items(load_config(FeederConfig, None, base), BadItems(FeederMetrics()))
    from grpo_producers.feeder import FeederState, save_state, schedule_fingerprint

    save_state(state, FeederState(schedule_fingerprint(items, load_config(FeederConfig, None, base)), 0, 5))
    with pytest.raises(ConfigError, match="another dataset or seed"):
        Feeder(load_config(FeederConfig, None, [*base, "seed=1"]))  # refused before any connection


def test_hf_source_without_the_datasets_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail like an absent package
    cfg = load_config(FeederConfig, None, ["source=hf", f"hf.path={tmp_path}"])
    with pytest.raises(ConfigError, match="pip install datasets"):
        load_items(cfg, BadItems(FeederMetrics()))


def test_hf_source(tmp_path: Path) -> None:
    import datasets as hf_datasets  # a dev dependency

    hf_datasets.Dataset.from_list([{"question": "q1", "answer": "1"}, {"question": "", "answer": "2"}]) \
        .save_to_disk(str(tmp_path / "ds"))
    cfg = load_config(FeederConfig, None, ["source=hf", f"hf.path={tmp_path / 'ds'}"])
    bad = BadItems(FeederMetrics())
    assert [(it.prompt, it.metadata) for it in load_items(cfg, bad)] == [("q1", {"answer": "1"})]
    assert bad.counts == {"missing_prompt": 1}


def test_hf_source_from_a_local_data_file(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "q1", "answer": "1"}\n{"question": "q2", "answer": "2"}\n')
    cfg = load_config(FeederConfig, None, ["source=hf", f"hf.path={data}"])
    items = load_items(cfg, BadItems(FeederMetrics()))
    assert [(it.prompt, it.metadata["answer"]) for it in items] == [("q1", "1"), ("q2", "2")]
