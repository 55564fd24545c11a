"""Typed config loading: YAML + key=value overrides, strict validation with actionable errors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

from grpo_core.config import (
    ConfigError,
    KafkaConfig,
    TopicsConfig,
    build,
    explain,
    load_config,
    opt,
    require,
    to_dict,
)
from grpo_core.contract import PipelineContract
from grpo_core.topics import TopicsFileConfig
from grpo_learner.config import LearnerConfig
from grpo_producers.config import ProducerConfig
from grpo_producers.feeder import FeederConfig
from grpo_stream.k8s import RUN_CONFIGS
from grpo_stream.run import RunConfig, role_configs
from grpo_verifiers.config import VerifierConfig

REPO = Path(__file__).resolve().parents[1]
# Every config file the project ships, with the typed config it must parse as. A new file must be added here.
SHIPPED = {"pipeline.yaml": PipelineContract, "learner.yaml": LearnerConfig, "feeder.yaml": FeederConfig,
           "producer.yaml": ProducerConfig, "verifier.yaml": VerifierConfig}
PIPELINE = REPO / "configs" / "pipeline.yaml"


@dataclass
class Inner:
    rate: float = opt(0.5, "a rate")
    mode: Literal["a", "b"] = opt("a", "a mode")

    def validate(self) -> None:
        require(0 <= self.rate <= 1, f"inner.rate: {self.rate} must be in [0, 1]")


@dataclass
class Outer:
    name: str = opt("run", "run name")
    steps: int = opt(10, "steps")
    tags: list[str] = opt(factory=list, help="tags")
    inner: Inner = opt(factory=Inner, help="inner section")


SHIPPED_FILES = sorted(str(p.relative_to(REPO / "configs")) for p in (REPO / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("name", SHIPPED_FILES)
def test_every_shipped_config_parses(name: str) -> None:
    """Role configs parse as their class; run configs (demo, the paper's grid) also validate every role in them."""
    if name in RUN_CONFIGS or name.startswith("paper/"):
        cfg = load_config(RunConfig, REPO / "configs" / name)
        assert set(role_configs(cfg, "127.0.0.1:9092")) >= {"learner", "producer", "verifier"}
        return
    if name.startswith("sweeps/"):  # a sweep: its own file, and every arm's run config with every role in it
        from grpo_stream.sweep import SweepConfig, plan

        sweep = load_config(SweepConfig, REPO / "configs" / name, [f"base={REPO / 'configs/demo.yaml'}"])
        assert len(plan(sweep)) == len(sweep.seeds) * len(sweep.arms)
        return
    assert name in SHIPPED, f"configs/{name} is not registered in SHIPPED with its config class"
    if SHIPPED[name] is PipelineContract:
        cfg = load_config(PipelineContract, PIPELINE)
        assert cfg.topic("groups") == "gsm8k-qwen0.5b-v10-i1.groups"
        return
    # Strict, as the role loads it at start-up (with the shared contract file): a misspelt key fails here.
    cfg = load_config(SHIPPED[name], REPO / "configs" / name, pipeline_file=PIPELINE)
    assert cfg.pipeline == load_config(PipelineContract, PIPELINE)


def test_a_misspelt_key_in_a_role_config_fails_like_at_start_up(tmp_path: Path) -> None:
    bad = tmp_path / "learner.yaml"
    bad.write_text((REPO / "configs/learner.yaml").read_text() + "publish_evry: 3\n")
    with pytest.raises(ConfigError, match="publish_evry: unknown key; did you mean 'publish_every'"):
        load_config(LearnerConfig, bad, pipeline_file=PIPELINE)


def test_run_config_cpus_name_roles_and_cpus_of_this_machine() -> None:
    cfg = load_config(RunConfig, REPO / "configs/demo.yaml", ["cpus.producer=[0]", "cpus.learner=[0]"])
    assert cfg.cpus == {"producer": [0], "learner": [0]}
    with pytest.raises(ConfigError, match="cpus.producers: not a role"):
        load_config(RunConfig, REPO / "configs/demo.yaml", ["cpus.producers=[0]"])
    with pytest.raises(ConfigError, match="cpus.learner"):
        load_config(RunConfig, REPO / "configs/demo.yaml", ["cpus.learner=[4096]"])


def test_run_config_refuses_a_backlog_below_one_batch() -> None:
    cfg = load_config(RunConfig, REPO / "configs/demo.yaml", ["producers.config.max_backlog_groups=4"])
    with pytest.raises(ConfigError, match="max_backlog_groups .4. must be 0 or >= learner.groups_per_batch .16."):
        role_configs(cfg, "127.0.0.1:9092")


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}  # without the trailing dot
    return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}


def test_paper_grid_differs_only_in_its_knobs() -> None:
    """The §5.1 grid (GSM8K) differs exactly in v, i and zero-variance masking, §5.2's (DeepScaleR) in v: the
    resolved learner configs of a family, every other key included, are equal once those knobs are set aside.
    i comes with its step budget (stage_steps, max_steps: 267 batches of 10 optimizer steps for i = 10)."""
    knob_keys = {"publish_every", "grad_steps_per_batch", "advantages.zero_variance", "stage_steps", "max_steps"}
    grid = {p.stem: _flat(to_dict(build(LearnerConfig, load_config(RunConfig, p).learner, "learner")))
            for p in (REPO / "configs/paper").glob("*.yaml")}
    knobs = {k: tuple(v[key] for key in ("publish_every", "grad_steps_per_batch", "advantages.zero_variance"))
             for k, v in grid.items()}
    assert knobs == {"gsm8k-v1-i1": (1, 1, "keep"), "gsm8k-v1-i1-zvmask": (1, 1, "mask"),
                     "gsm8k-v10-i1": (10, 1, "keep"), "gsm8k-v1-i10": (1, 10, "keep"),
                     "deepscaler-v1-i1": (1, 1, "mask"), "deepscaler-v10-i1": (10, 1, "mask")}
    for family in ("gsm8k", "deepscaler"):
        rest = [{k: v for k, v in cfg.items() if k not in knob_keys} for name, cfg in grid.items()
                if name.startswith(family)]
        assert len(rest) >= 2 and all(r == rest[0] for r in rest), family


def test_shipped_topic_plan_equals_the_code_default() -> None:
    # The YAML documents the plan; it must not silently drift from the defaults the code uses.
    assert load_config(PipelineContract, PIPELINE).topics == TopicsConfig()


def test_yaml_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("name: x\ninner:\n  rate: 0.25\n")
    cfg = load_config(Outer, path, ["steps=42", "inner.mode=b", "tags=[p, q]"])
    assert (cfg.name, cfg.steps, cfg.tags, cfg.inner.rate, cfg.inner.mode) == ("x", 42, ["p", "q"], 0.25, "b")


def test_partial_nested_section_keeps_other_defaults() -> None:
    cfg = load_config(TopicsFileConfig, None, ["pipeline.topics.groups.partitions=8"]).pipeline
    assert cfg.topics.groups.partitions == 8
    assert cfg.topics.groups.name == "groups" and cfg.topics.weights.cleanup_policy == "compact"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["stepz=3"], "stepz: unknown key; did you mean 'steps'?"),
        (["steps=many"], "steps: expected int"),
        (["steps=true"], "steps: expected an integer"),
        (["inner.mode=c"], "inner.mode: 'c' is not one of ['a', 'b']"),
        (["inner.rate=2"], "inner.rate: 2.0 must be in [0, 1]"),
        (["inner=3"], "inner: expected a mapping"),
        (["noequals"], "expected key.sub=value"),
    ],
)
def test_errors_name_the_key_and_the_fix(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(Outer, None, overrides)
    assert message in str(info.value)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Outer, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(Outer, bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(Outer, bad)


def test_topic_plan_validation() -> None:
    with pytest.raises(ConfigError, match="names must be distinct"):
        load_config(TopicsFileConfig, None, ["pipeline.topics.dlq.name=groups"])
    with pytest.raises(ConfigError, match="must be compact"):
        load_config(TopicsFileConfig, None, ["pipeline.topics.weights.cleanup_policy=delete"])
    with pytest.raises(ConfigError, match="partitions: must be >= 1"):
        load_config(TopicsFileConfig, None, ["pipeline.topics.groups.partitions=0"])


def test_kafka_security_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="sasl_mechanism: required"):
        load_config(KafkaConfig, None, ["security_protocol=SASL_SSL"])
    with pytest.raises(ConfigError, match="KAFKA_SECRET is not set"):
        load_config(KafkaConfig, None, ["security_protocol=SASL_SSL", "sasl_mechanism=PLAIN",
                                        "sasl_password_env=KAFKA_SECRET"])
    monkeypatch.setenv("KAFKA_BOOTSTRAP", "example:9092")
    assert KafkaConfig().resolved_bootstrap() == "example:9092"
    assert KafkaConfig(bootstrap="other:1").resolved_bootstrap() == "other:1"


def test_explain_lists_every_leaf_with_help() -> None:
    lines = list(explain(Outer))
    assert "inner.rate = 0.5  # a rate" in lines
    assert any(line.startswith("tags = []") for line in lines)
    topic_lines = list(explain(TopicsFileConfig))
    assert "pipeline.topics.weights.cleanup_policy = 'compact'  # cleanup.policy." in topic_lines
    assert any(line.startswith("kafka.bootstrap = None") for line in topic_lines)


def test_truncated_sampling_is_refused_with_sampling_logprobs() -> None:
    """pipeline.logprobs=sampling reports the tempered distribution; a top-p/top-k nucleus is one the learner
    cannot recompute, so the producer refuses it at start-up (raw logprobs, or greedy, are fine)."""
    from grpo_producers.config import ProducerConfig

    base = ["backend.model=/m", "sampling.temperature=0.7"]
    with pytest.raises(ConfigError, match="renormalised nucleus"):
        load_config(ProducerConfig, None, [*base, "sampling.top_p=0.9"])
    cfg = load_config(ProducerConfig, None, [*base, "sampling.top_k=20", "pipeline.logprobs=raw"])
    assert (cfg.backend_config().logprobs, cfg.logprob_temperature()) == ("raw", 0.0)
    cfg = load_config(ProducerConfig, None, base)
    assert (cfg.backend_config().logprobs, cfg.logprob_temperature()) == ("sampling", 0.7)


def test_verifier_min_group_size_above_g_is_refused_naming_both_keys() -> None:
    """A partial group has fewer than G members, so min_group_size > G could never publish one."""
    one_line = r"^min_group_size: 5 is above pipeline\.group_size=4, [^\n]* set it in \[1, 4\]$"
    with pytest.raises(ConfigError, match=one_line):
        load_config(VerifierConfig, None, ["pipeline.group_size=4", "min_group_size=5"])
    assert load_config(VerifierConfig, None, ["pipeline.group_size=4", "min_group_size=4"]).min_group_size == 4
    cfg = load_config(RunConfig, REPO / "configs/demo.yaml", ["verifiers.config.min_group_size=17"])
    with pytest.raises(ConfigError, match="verifier: min_group_size: 17 is above pipeline.group_size=16"):
        role_configs(cfg, "127.0.0.1:9092")


def test_a_model_setting_is_a_model_directory_or_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked against this machine by check_paths() (the CLI before a role starts, `run` before anything starts),
    not by load_config: a config for another machine (k8s check) still validates here."""
    from grpo_core.config import check_model_path, check_paths

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(ConfigError, match=f"^model.path: {model} has no config.json"):
        check_model_path(str(model), "model.path")
    (model / "config.json").write_text("{}")
    check_model_path(str(model), "model.path")
    with pytest.raises(ConfigError, match="is a file"):
        check_model_path(str(model / "config.json"), "model.path")
    for missing in (str(tmp_path / "gone"), "runs/demo/model", "./model", "../model"):
        with pytest.raises(ConfigError, match=f"^model.path: {missing}: no such directory"):
            check_model_path(missing, "model.path")
    check_model_path("Qwen/Qwen2.5-0.5B-Instruct", "model.path")  # a hub id: its download is the loader's
    # With the hub off nothing can be downloaded: a hub id must be in the local cache.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError, match="not in the local cache"):
        check_model_path("Qwen/Qwen2.5-0.5B-Instruct", "backend.model")
    (tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B-Instruct").mkdir(parents=True)
    check_model_path("Qwen/Qwen2.5-0.5B-Instruct", "backend.model")
    # load_config does not look at the machine; check_paths does, naming the role's key.
    learner = load_config(LearnerConfig, None, [f"model.path={tmp_path / 'gone'}"])
    with pytest.raises(ConfigError, match="^model.path: "):
        check_paths(learner)
    producer = load_config(ProducerConfig, None, [f"backend.model={model}", f"backend.tokenizer={tmp_path}/x/y"])
    with pytest.raises(ConfigError, match="^backend.tokenizer: "):
        check_paths(producer)


@pytest.mark.parametrize("name", ["../evil", "a/b", ".x", "-x", "", "x" * 201, "a b"])
def test_a_run_name_must_be_safe_for_topics_and_directories(name: str) -> None:
    with pytest.raises(ConfigError, match=r"^name: .*\[A-Za-z0-9._-\]"):
        load_config(RunConfig, REPO / "configs/demo.yaml", [f"name={name!r}" if name else "name=''"])


def test_kafka_connect_timeout_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="kafka.connect_timeout_s: must be > 0"):
        load_config(KafkaConfig, None, ["connect_timeout_s=0"])
    assert load_config(KafkaConfig, None, []).connect_timeout_s <= 60
