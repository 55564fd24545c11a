"""reasoning-gym end to end: the feeder's ``reasoning_gym`` source (seeded, weighted, a disjoint held-out split, checked
at start-up) and the verifier's ``reasoning_gym`` reward (answer extraction, the dataset's own score_answer on the
entry carried in the metadata), then both through the real broker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from test_feeder import read_all
from test_verifier_service import read_groups

from grpo_core import wire
from grpo_core.config import ConfigError, KafkaConfig, load_config, to_dict
from grpo_core.contract import PipelineContract
from grpo_core.kafka_io import make_producer
from grpo_producers.feeder import BadItems, Feeder, FeederConfig, FeederMetrics, load_items
from grpo_producers.reasoning_gym_source import EVAL_SEED_OFFSET
from grpo_stream.run import RunConfig, role_configs
from grpo_verifiers.config import VerifierConfig
from grpo_verifiers.rewards import RewardConfig, RewardPool, RewardRequest, RewardTerm
from grpo_verifiers.rewards.reasoning_gym_reward import extract, score

REPO = Path(__file__).resolve().parents[1]
MIX = "[{name: basic_arithmetic, weight: 3}, {name: leg_counting, weight: 1}]"
TINY_LEGS = "[{name: leg_counting, config: {min_animals: 1, max_animals: 1, max_instances: 3}}]"


def rg_cfg(*overrides: str) -> FeederConfig:
    return load_config(FeederConfig, None, ["source=reasoning_gym", "name=rg", *overrides])


def items(*overrides: str) -> tuple[list[Any], Counter[str]]:
    bad = BadItems(FeederMetrics())
    return load_items(rg_cfg(*overrides), bad), bad.counts


def entry_of(item: Any) -> dict[str, Any]:
    return json.loads(item.metadata["rg_entry"])


# ------------------------------------------------------------------------------------------ the source


def test_items_are_reasoning_gyms_own_entries_deterministic_under_the_seed() -> None:
    import reasoning_gym

    legs = ("reasoning_gym.datasets=[leg_counting]", "reasoning_gym.size=20")
    got, bad = items(*legs, "reasoning_gym.user='Q: {question}'")
    assert len(got) == 20 and not bad
    first = got[0]
    entry = entry_of(first)
    assert first.task == "reasoning_gym" and first.prompt_id.startswith("rg-train0-")
    assert first.prompt.startswith("Given a problem") and "<answer>answer here</answer>" in first.prompt
    assert first.prompt.endswith("Q: " + entry["question"])
    assert first.metadata["answer"] == entry["answer"] and first.metadata["rg_dataset"] == "leg_counting"
    assert first.metadata["rg_config"] == "{}"
    # The entry reasoning-gym itself generates for index 0 of this composite (sub-dataset seed = seed + 1).
    own = reasoning_gym.create_dataset("leg_counting", seed=1, size=20)[0]
    assert entry["question"] == own["question"] and entry["answer"] == own["answer"]

    assert items(*legs, "reasoning_gym.user='Q: {question}'")[0] == got
    other = items(*legs, "reasoning_gym.seed=1")[0]
    assert [it.prompt_id for it in other] != [it.prompt_id for it in got]
    # Another process (another str hash seed) generates the same ids: what resuming and the held-out split rely on.
    code = ("from grpo_core.config import load_config; from grpo_producers.feeder import *\n"
            "cfg = load_config(FeederConfig, None, ['source=reasoning_gym', 'name=rg', "
            "'reasoning_gym.datasets=[leg_counting]', 'reasoning_gym.size=20'])\n"
            "print(','.join(i.prompt_id for i in load_items(cfg, BadItems(FeederMetrics()))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert out.split(",") == [it.prompt_id for it in got]


def test_composite_weights_pick_the_datasets() -> None:
    got, _ = items(f"reasoning_gym.datasets={MIX}", "reasoning_gym.size=800")
    shares = Counter(it.metadata["rg_dataset"] for it in got)
    assert set(shares) == {"basic_arithmetic", "leg_counting"} and sum(shares.values()) == 800
    assert 0.70 < shares["basic_arithmetic"] / 800 < 0.80  # weight 3 of 4
    for it in got:
        assert entry_of(it)["metadata"]["source_dataset"] == it.metadata["rg_dataset"]


def test_the_held_out_split_is_disjoint_by_seed_and_by_question() -> None:
    train, _ = items(f"reasoning_gym.datasets={MIX}", "reasoning_gym.size=300")
    held, bad = items(f"reasoning_gym.datasets={MIX}", "reasoning_gym.size=300", "reasoning_gym.split=eval",
                      "reasoning_gym.eval_size=100")
    assert all(it.prompt_id.startswith("rg-eval") for it in held) and len(held) + bad["in_train"] == 100
    assert not {entry_of(it)["question"] for it in train} & {entry_of(it)["question"] for it in held}
    # A problem space this small repeats questions across seeds: those are taken out of the held-out split.
    small_train, _ = items(f"reasoning_gym.datasets={TINY_LEGS}", "reasoning_gym.size=50")
    small_held, bad = items(f"reasoning_gym.datasets={TINY_LEGS}", "reasoning_gym.size=50",
                            "reasoning_gym.split=eval", "reasoning_gym.eval_size=50")
    assert bad["in_train"] > 0 and len(small_held) + bad["in_train"] == 50
    assert not {entry_of(it)["question"] for it in small_train} & {entry_of(it)["question"] for it in small_held}
    assert EVAL_SEED_OFFSET > 2 * 300


@pytest.mark.parametrize(("override", "message"), [
    ("reasoning_gym.datasets=[leg_count]", "unknown reasoning-gym dataset 'leg_count'; did you mean 'leg_counting'"),
    ("reasoning_gym.datasets=[{name: leg_counting, config: {min_animal: 1}}]", "did you mean 'min_animals'"),
    ("reasoning_gym.datasets=[{name: leg_counting, config: {seed: 3}}]", "set by reasoning_gym.seed/size"),
    ("reasoning_gym.datasets=[{name: leg_counting, config: {min_animals: 0}}]", "leg_counting refuses"),
    ("reasoning_gym.datasets=[{name: decimal_arithmetic, config: {min_num_decimal_places: 3, "
     "max_num_decimal_places: 2}}]", "generating item 0 failed"),
    ("reasoning_gym.datasets=[leg_counting, leg_counting]", "names a dataset twice"),
    ("reasoning_gym.datasets=[composite]", "list the datasets of a composite here"),
    ("reasoning_gym.user='{prompt}'", "must contain {question}"),
    ("reasoning_gym.split=test", "not one of"),
])
def test_start_up_validation_says_what_to_change(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace("}", r"\}")):
        rg_cfg(override)


def test_without_the_package_both_sides_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` fails as if absent
    with pytest.raises(ConfigError, match=r"grpo-stream\[reasoning-gym\]"):
        rg_cfg()
    rg_cfg("source=synthetic")  # another source never needs it
    with pytest.raises(ConfigError, match=r"reasoning_gym reward needs the reasoning-gym package.*grpo-stream\["):
        load_config(RewardConfig, None, ["by_task={reasoning_gym: [{name: reasoning_gym}]}"])


# ------------------------------------------------------------------------------------------ the reward


@pytest.mark.parametrize(("text", "params", "expected"), [
    ("<think>2+2</think><answer>4</answer>", {}, "4"),
    ("<answer> 4 \n</answer>", {}, "4"),
    ("<answer>3</answer> no wait <answer>4</answer>", {}, "4"),  # the last one counts
    ("<answer>4", {}, None),  # cut off before it closed
    ("The answer is 4", {}, None),
    ("<final>4</final>", {"tag": "final"}, "4"),
    ("... so the answer is: 4.", {"pattern": r"answer is:?\s*(-?\d+)"}, "4"),
    ("#### 4", {"pattern": r"#### \S+"}, "#### 4"),  # no group: the whole match
])
def test_answer_extraction(text: str, params: dict[str, Any], expected: str | None) -> None:
    assert extract(text, **params) == expected


@pytest.mark.parametrize("dataset", ["basic_arithmetic", "leg_counting", "spell_backward"])
def test_the_reward_is_the_datasets_own_score_answer(dataset: str) -> None:
    got, _ = items(f"reasoning_gym.datasets=[{dataset}]", "reasoning_gym.size=5")
    for it in got:
        answer = it.metadata["answer"]
        assert score(f"<think>working</think>\n<answer>{answer}</answer><|im_end|>", it.prompt, it.metadata) == \
            (1.0, {"dataset": dataset, "extracted": answer})
        assert score("<answer>#</answer>", it.prompt, it.metadata)[0] == 0.0
        assert score(f"It is {answer}.", it.prompt, it.metadata) == (0.0, {"dataset": dataset, "extracted": None})
    if dataset == "spell_backward":  # reasoning-gym's partial credit comes through: a right prefix earns some
        answer = got[0].metadata["answer"]
        partial = score(f"<answer>{answer[:-1]}#</answer>", "", got[0].metadata)[0]
        assert 0.0 < partial < 1.0


def test_the_datasets_options_travel_with_the_entry() -> None:
    """decimal_arithmetic's score_answer reads its config (the tolerance): the reward rebuilds it from rg_config."""
    from decimal import Decimal

    options = "{min_num_decimal_places: 1, max_num_decimal_places: 2}"
    [it, *_] = items(f"reasoning_gym.datasets=[{{name: decimal_arithmetic, config: {options}}}]",
                     "reasoning_gym.size=3")[0]
    near = str(Decimal(it.metadata["answer"]) + Decimal("0.005"))
    assert json.loads(it.metadata["rg_config"]) == {"min_num_decimal_places": 1, "max_num_decimal_places": 2}
    assert score(f"<answer>{near}</answer>", "", it.metadata)[0] == 1.0  # within 10^-2
    assert score(f"<answer>{near}</answer>", "", {**it.metadata, "rg_config": "{}"})[0] == 0.0  # default 10^-3


def test_unusable_metadata_is_a_failure_of_the_input_never_retried() -> None:
    [it] = items("reasoning_gym.datasets=[basic_arithmetic]", "reasoning_gym.size=1")[0]
    good = f"<answer>{it.metadata['answer']}</answer>"
    broken = [{}, {**it.metadata, "rg_entry": "{not json"}, {**it.metadata, "rg_dataset": "no_such_dataset"},
              {**it.metadata, "rg_config": '{"bogus": 1}'}]
    cfg = RewardConfig(by_task={"reasoning_gym": [RewardTerm("reasoning_gym")]}, workers=1, retries=1)
    with RewardPool(cfg) as pool:
        results = pool.score_batch([RewardRequest(good, it.prompt, "reasoning_gym", it.metadata)]
                                   + [RewardRequest(good, it.prompt, "reasoning_gym", m) for m in broken])
        assert (results[0].reward, results[0].failed) == (1.0, False)
        for r in results[1:]:
            assert r.failed and r.error is not None and r.error.startswith("bad_input: "), r.error
        assert pool.stats()["retried"] == 0


def test_the_shipped_gpu_config_feeds_and_scores() -> None:
    run = load_config(RunConfig, REPO / "configs/reasoning-gym.yaml")
    roles = role_configs(run, "127.0.0.1:9092")
    feeder = load_config(FeederConfig, None, [f"{k}={json.dumps(v)}" for k, v in roles["feeder"].items()]
                         + ["reasoning_gym.size=50"])
    assert {it.metadata["rg_dataset"] for it in load_items(feeder, BadItems(FeederMetrics()))} == \
        {"basic_arithmetic", "leg_counting"}
    verifier = load_config(VerifierConfig, None, [f"{k}={json.dumps(v)}" for k, v in roles["verifier"].items()])
    assert [t.name for t in verifier.rewards.terms_for(feeder.reasoning_gym.task) or []] == ["reasoning_gym"]


# ------------------------------------------------------------------------------------------ through the broker

G = 4


def _completions(task: wire.PromptTask) -> list[wire.Completion]:
    """G members: right with reasoning around it, wrong, untagged (no answer), right."""
    answer = task.metadata["answer"]
    texts = [f"<think>Let me work it out.</think>\n<answer>{answer}</answer>", "<answer>#</answer>",
             f"I believe it is {answer}.", f"<answer> {answer} </answer>"]
    return [wire.Completion(
        group_id=task.group_id, index=i, group_size=G, prompt_id=task.prompt_id, task=task.task,
        prompt_token_ids=np.arange(4, dtype=np.int32), completion_token_ids=np.arange(3, dtype=np.int32) + i,
        behaviour_logprobs=np.full(3, -1.0, dtype=np.float32), policy_version=0, producer_id="p",
        finish_reason="stop", prompt=task.prompt, completion=text, epoch=task.epoch,
        metadata={**task.metadata, "attempt": "a"}) for i, text in enumerate(texts)]


def _flags(section: dict[str, Any]) -> list[str]:
    return [f"{k}={yaml.safe_dump(v, default_flow_style=True, width=1 << 20).strip()}" for k, v in section.items()]


def test_fed_prompts_are_scored_by_their_dataset_through_the_broker(
        kafka_cfg: KafkaConfig, plan: PipelineContract, tmp_path: Path, running: Callable) -> None:
    """The feeder publishes reasoning-gym prompts of three datasets; each group's right answers score 1 and its
    wrong and untagged ones 0, through the verifier's sandboxed reward, into one ScoredGroup per prompt."""
    contract = {**to_dict(plan), "group_size": G}
    datasets = "[basic_arithmetic, leg_counting, spell_backward]"
    feeder = Feeder(load_config(FeederConfig, None, [
        *_flags({"kafka": {"bootstrap": kafka_cfg.bootstrap}, "pipeline": contract}), "source=reasoning_gym",
        f"reasoning_gym.datasets={datasets}", "reasoning_gym.size=9", f"state_path={tmp_path / 'state.json'}",
        "metrics.port=-1"]))
    try:
        assert feeder.run() == 9
    finally:
        feeder.close()
    tasks = [task for _, task in read_all(kafka_cfg, plan.topic("prompts"))]
    assert len(tasks) == 9 and {t.metadata["rg_dataset"] for t in tasks} == {
        "basic_arithmetic", "leg_counting", "spell_backward"}

    producer = make_producer(kafka_cfg, "test")
    for task in tasks:
        for c in _completions(task):
            producer.send(plan.topic("completions"), key=c.group_id.encode(), value=wire.encode(c))
    producer.flush()
    producer.close()
    rewards = {"by_task": {"reasoning_gym": [{"name": "reasoning_gym"}]}, "workers": 1}
    running(load_config(VerifierConfig, None, _flags({"kafka": {"bootstrap": kafka_cfg.bootstrap},
                                                      "pipeline": contract, "metrics": {"port": -1},
                                                      "rewards": rewards})))
    groups = {g.group_id: g for g in read_groups(kafka_cfg, plan.topic("groups"), 9)}
    assert set(groups) == {t.group_id for t in tasks}
    for g in groups.values():
        assert (g.rewards, g.failed, g.partial) == ([1.0, 0.0, 0.0, 1.0], [], False), g.reward_info
        assert (g.reward_mean, g.task) == (pytest.approx(0.5), "reasoning_gym")

