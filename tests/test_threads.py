"""The run supervisor's thread budget (``grpo_stream.threads``): each child computes on its share of the CPUs.

More torch threads than a process's share of the cores spin-wait against the other roles (the demo made half
the learner steps a second that way); the rule and the environment a child really starts with are checked here."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import pytest

from grpo_core.config import ConfigError, load_config
from grpo_stream.run import Child, RunConfig
from grpo_stream.threads import child_env, child_threads

REPO = Path(__file__).resolve().parents[1]


def _cfg(*overrides: str) -> RunConfig:
    return load_config(RunConfig, REPO / "configs/demo.yaml", list(overrides))


def test_unpinned_compute_roles_share_the_machine() -> None:
    # The demo: two producers and the learner on 2 CPUs -> one thread each; the verifier and feeder always 1.
    assert child_threads(_cfg(), {0, 1}) == {"feeder": 1, "producer": 1, "verifier": 1, "learner": 1}
    assert child_threads(_cfg(), set(range(8))) == {"feeder": 1, "producer": 2, "verifier": 1, "learner": 2}
    assert child_threads(_cfg("producers.count=1"), set(range(8)))["learner"] == 4


def test_pinned_roles_share_their_cpus_and_named_roles_get_what_they_name() -> None:
    # A 4-CPU machine's pinning (built without load_config, which checks the CPUs against this machine's).
    pinned = dataclasses.replace(_cfg("producers.count=1"), cpus={"producer": [0], "learner": [1, 2, 3]})
    assert child_threads(pinned, set(range(4))) == {"feeder": 1, "producer": 1, "verifier": 1, "learner": 3}
    # Two producers on one pinned CPU still get a thread each; the learner alone takes the unpinned CPUs.
    mixed = dataclasses.replace(_cfg(), cpus={"producer": [0]})
    assert child_threads(mixed, set(range(4))) == {"feeder": 1, "producer": 1, "verifier": 1, "learner": 3}
    assert child_threads(_cfg("threads.learner=6", "threads.verifier=2"), {0, 1})["learner"] == 6
    assert child_threads(_cfg("threads.verifier=2"), {0, 1})["verifier"] == 2


def test_an_operators_omp_num_threads_is_kept_unless_the_config_names_the_role() -> None:
    assert child_env(_cfg(), "learner", {"OMP_NUM_THREADS": "3"}) == {}
    assert child_env(_cfg("threads.learner=2"), "learner", {"OMP_NUM_THREADS": "3"}) == {"OMP_NUM_THREADS": "2"}
    assert child_env(_cfg(), "producer", {}) == {"OMP_NUM_THREADS": str(child_threads(_cfg())["producer"])}


def test_bad_thread_settings_are_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="threads.trainer: not a role"):
        _cfg("threads.trainer=2")
    with pytest.raises(ConfigError, match="threads.learner: must be a whole number >= 1"):
        _cfg("threads.learner=0")


def test_a_child_computes_on_the_threads_it_was_given(tmp_path: Path) -> None:
    code = "import torch; print(torch.get_num_threads())"
    child = Child("learner", [sys.executable, "-c", code], (tmp_path / "c.log").open("w"), lambda n, line: None,
                  env={"OMP_NUM_THREADS": "1"})
    child.start()
    assert child.proc is not None and child.proc.wait(timeout=60) == 0
    time.sleep(0.2)  # the pump thread writes the last line
    assert (tmp_path / "c.log").read_text().strip() == "1"
