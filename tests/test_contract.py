"""The pipeline contract: one section every role loads, names derived from the run, disagreements refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from grpo_core.config import ConfigError, load_config, to_dict
from grpo_core.contract import PipelineContract, check_same_contract
from grpo_learner.config import LearnerConfig
from grpo_producers.config import ProducerConfig
from grpo_stream.run import RunConfig, role_configs
from grpo_verifiers.config import VerifierConfig

REPO = Path(__file__).resolve().parents[1]


def test_names_derive_from_the_run_unless_a_prefix_is_given() -> None:
    c = PipelineContract(run="exp7")
    assert (c.topic("prompts"), c.topic("weight_data"), c.group("learner")) == (
        "exp7.prompts", "exp7.weight-data", "exp7.learner")
    assert [s.name for s in c.topic_plan()] == [f"exp7.{n}" for n in
                                                ("prompts", "completions", "groups", "weights", "weight-data", "dlq")]
    bare = PipelineContract(run="exp7", prefix="")
    assert (bare.topic("groups"), bare.group("producers")) == ("groups", "producers")
    assert PipelineContract(run="exp7", prefix="team-a.").topic("dlq") == "team-a.dlq"
    assert c.topic_spec("weights").cleanup_policy == "compact"


def test_the_digest_changes_with_every_setting() -> None:
    base = PipelineContract(run="r")
    assert base.digest() == PipelineContract(run="r").digest()
    changed = [dataclasses.replace(base, group_size=8), dataclasses.replace(base, stats_eps=1e-3),
               dataclasses.replace(base, max_new_tokens=64), dataclasses.replace(base, max_staleness=1),
               dataclasses.replace(base, run="s"), dataclasses.replace(base, prefix="")]
    assert len({c.digest() for c in changed} | {base.digest()}) == len(changed) + 1
    check_same_contract(base, base.digest(), "the learner")
    check_same_contract(base, "", "an old learner")  # a peer that does not say is not refused
    with pytest.raises(ConfigError, match=rf"the learner runs with contract {changed[0].digest()}, this process "
                                          rf"with {base.digest()}"):
        check_same_contract(base, changed[0].digest(), "the learner")


@pytest.mark.parametrize(("override", "message"), [
    ("run=../x", "pipeline.run"), ("prefix=a/b", "pipeline.prefix"), ("group_size=0", "pipeline.group_size"),
    ("stats_eps=1.5", "pipeline.stats_eps"), ("max_new_tokens=0", "pipeline.max_new_tokens"),
    ("max_staleness=-2", "pipeline.max_staleness"), ("groups.learner=''", "pipeline.groups.learner"),
])
def test_contract_validation_names_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(PipelineContract, None, [override])


def test_producers_may_not_run_further_behind_than_the_learner_accepts() -> None:
    cfg = load_config(ProducerConfig, None, ["backend.model=m", "pipeline.max_staleness=3"])
    assert cfg.version_lag == 3  # by default the contract's bound
    assert load_config(ProducerConfig, None, ["backend.model=m", "max_version_lag=1"]).version_lag == 1
    with pytest.raises(ConfigError, match=r"max_version_lag: 5 with pipeline.max_staleness=3.*\[0, 3\]"):
        load_config(ProducerConfig, None, ["backend.model=m", "pipeline.max_staleness=3", "max_version_lag=5"])
    with pytest.raises(ConfigError, match="max_version_lag: -1 with pipeline.max_staleness=4"):
        load_config(ProducerConfig, None, ["backend.model=m", "max_version_lag=-1"])
    assert load_config(ProducerConfig, None, ["backend.model=m", "pipeline.max_staleness=-1",
                                              "max_version_lag=-1"]).version_lag == -1


def test_sampling_length_comes_from_the_contract() -> None:
    cfg = load_config(ProducerConfig, None, ["backend.model=m", "pipeline.max_new_tokens=48"])
    assert cfg.sampling.max_tokens is None and cfg.sampling_params().max_tokens == 48
    assert load_config(ProducerConfig, None, ["backend.model=m", "pipeline.max_new_tokens=48",
                                              "sampling.max_tokens=16"]).sampling_params().max_tokens == 16
    with pytest.raises(ConfigError, match="sampling.max_tokens: 64 exceeds pipeline.max_new_tokens=48"):
        load_config(ProducerConfig, None, ["backend.model=m", "pipeline.max_new_tokens=48", "sampling.max_tokens=64"])
    learner = load_config(LearnerConfig, None, ["model.path=m", "pipeline.max_new_tokens=48",
                                                "loss.agg=seq_mean_token_sum_norm"])
    assert learner.loss.max_len_norm is None and learner.loss_config().max_len_norm == 48


def test_one_contract_file_for_every_role(tmp_path: Path) -> None:
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(yaml.safe_dump({"run": "shared", "group_size": 4}))
    roles = [load_config(VerifierConfig, None, pipeline_file=pipeline),
             load_config(LearnerConfig, None, ["model.path=m"], pipeline_file=pipeline),
             load_config(ProducerConfig, None, ["backend.model=m"], pipeline_file=pipeline)]
    assert {r.pipeline.digest() for r in roles} == {roles[0].pipeline.digest()}
    assert roles[1].pipeline.group("learner") == "shared.learner" and roles[2].pipeline.group_size == 4
    own = tmp_path / "verifier.yaml"
    own.write_text(yaml.safe_dump({"pipeline": {"group_size": 8}}))
    with pytest.raises(ConfigError, match="has a pipeline section and --pipeline .* was given"):
        load_config(VerifierConfig, own, pipeline_file=pipeline)
    # Overrides still apply on top of the file (a one-off experiment on the command line).
    assert load_config(VerifierConfig, None, ["pipeline.group_size=2"], pipeline_file=pipeline).pipeline.group_size == 2


def test_a_run_gives_every_role_the_same_contract_named_after_the_run() -> None:
    cfg = load_config(RunConfig, REPO / "configs/demo.yaml", ["name=exp9"])
    roles = role_configs(cfg, "127.0.0.1:9092")
    assert {r["pipeline"]["run"] for r in roles.values()} == {"exp9"}
    assert len({yaml.safe_dump(r["pipeline"]) for r in roles.values()}) == 1
    assert roles["learner"]["pipeline"] == to_dict(cfg.contract)
    with pytest.raises(ConfigError, match="learner.pipeline: the contract is the run's pipeline section"):
        load_config(RunConfig, REPO / "configs/demo.yaml", ["learner.pipeline.group_size=8"])


def test_a_restarted_learner_republishes_over_another_contracts_announcement() -> None:
    from grpo_core import wire
    from grpo_learner.service import announcement_is_behind

    def ann(version: int, contract: str) -> wire.WeightsAnnouncement:
        return wire.WeightsAnnouncement(run="r", version=version, store="fs", location="r/v/m", sha256="0" * 64,
                                        size_bytes=1, contract=contract)

    mine = PipelineContract(run="r").digest()
    assert announcement_is_behind(None, 0, 4, mine)
    assert not announcement_is_behind(ann(8, mine), 9, 4, mine)  # v8 covers steps 8..11
    assert announcement_is_behind(ann(4, mine), 9, 4, mine)  # the checkpoint is past it: publish v8 again
    assert announcement_is_behind(ann(50, "another"), 0, 4, mine)  # a reused run name with other settings
