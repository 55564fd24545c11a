"""``grpo-stream bench async``: the report's arithmetic on known curves, and a short real run of two arms (S and
the pipeline with in-flight swaps) that prints every field and writes the JSON and the PNG."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from grpo_stream.bench import async_bench as ab
from grpo_stream.bench import async_report as ar
from grpo_stream.bench import cpu_use
from grpo_stream.bench.cpu_use import STEAL_WARN, read_ticks, stolen


def fake(curve: list[tuple[float, float]], gen_s: float = 0.0, train_s: float = 0.0) -> dict:
    return {"curve": curve, "wall_s": 10.0, "tokens": 500, "engine_busy": 0.5, "learner_busy": 0.25,
            "mean_staleness": 1.5, "steps": 20, "gen_s": gen_s, "train_s": train_s}


def test_the_report_times_each_arm_to_the_target_against_s(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    results = {"S": [fake([(0, 0.3), (4, 0.5), (8, 0.7), (9, 0.7)], gen_s=6.0, train_s=4.0)],
               "P v1 inflight": [fake([(0, 0.3), (2, 0.6), (6, 0.8)]), fake([(0, 0.3), (3, 0.65), (4, 0.6)])],
               "P v4 between": [fake([(0, 0.3), (9, 0.4)])]}
    summary = ar.report(results, 0.6, tmp_path)
    assert summary["ideal_ratio"] == pytest.approx(0.6)  # max(6, 4) / (6 + 4)
    p = summary["arms"]["P v1 inflight"]
    assert [r["time_to_target_s"] for r in p["runs"]] == [2, 3]
    assert p["median"]["ratio_to_S"] == pytest.approx(2.5 / 8) and p["min"]["ratio_to_S"] == pytest.approx(2 / 8)
    assert summary["arms"]["P v4 between"]["median"]["time_to_target_s"] is None  # never reached: no ratio
    assert summary["best_pipeline_ratio"] == pytest.approx(2.5 / 8)
    assert p["runs"][0]["reward_gain_per_s"] == pytest.approx(0.05) and p["runs"][0]["tokens_per_s"] == 50
    by_target = summary["ratio_by_target"]  # S holds 0.5 from 4 s; P v1's runs from 2 s and 3 s
    assert list(by_target) == ["0.50", "0.55", "0.60", "0.65", "0.70"]
    assert by_target["0.50"]["P v1 inflight"] == pytest.approx(2.5 / 4) and by_target["0.50"]["P v4 between"] is None
    assert by_target["0.65"]["P v1 inflight"] is None  # 0.8 at the last point only: unconfirmed
    out = capsys.readouterr().out
    assert all(field in out for field in ar.FIELDS) and "ideal ratio 0.600" in out and "min/max" in out
    assert all(key in out for key in ar.DYNAMICS) and set(summary["dynamics"]) == set(results)
    assert json.loads((tmp_path / "async.json").read_text())["target"] == 0.6
    assert (tmp_path / "async.png").stat().st_size > 1000


def test_a_repeat_that_never_reaches_the_target_counts_as_the_slowest(tmp_path: Path) -> None:
    """The median used to drop such a repeat: an arm with repeats at 8 s, 9 s and never was reported at 8.5 s,
    from its two luckier repeats (in one run, two arms each had a repeat whose learner was 30x slower per step,
    and each arm was reported from its other two). Counted as slower than any repeat that reached the target,
    the median is 9 s; with two of three repeats never there, the arm has no median."""
    reach = {8: [(0, 0.3), (8, 0.7), (9, 0.7)], 9: [(0, 0.3), (9, 0.7), (10, 0.7)], None: [(0, 0.3), (10, 0.4)]}
    s = [fake(reach[8], gen_s=1, train_s=1), fake(reach[None]), fake(reach[9])]
    summary = ar.report({"S": s, "P v4 between": [fake(reach[k]) for k in (8, None, 9)],
                         "P v4 inflight": [fake(reach[k]) for k in (None, 8, None)]}, 0.6, tmp_path)
    s_row, p, q = (summary["arms"][k] for k in ("S", "P v4 between", "P v4 inflight"))
    assert s_row["median"]["time_to_target_s"] == 9 and p["median"]["time_to_target_s"] == 9
    assert p["median"]["ratio_to_S"] == 1 and p["min"]["time_to_target_s"] == 8
    assert p["max"]["time_to_target_s"] is None and p["max"]["steps"] == 20  # "-": a repeat never got there
    assert q["median"]["time_to_target_s"] is None and summary["best_pipeline_ratio"] == 1
    assert summary["ratio_by_target"]["0.60"] == {"P v4 between": 1, "P v4 inflight": None}
    assert ar._median_to_target([4, None]) is None and ar._median_to_target([4, 6]) == 5
    assert ar._median_to_target([]) is None


def test_the_learner_metrics_of_an_arm_are_averaged_over_its_first_steps_and_all() -> None:
    steps = [{"step": i, "entropy": 1.0 if i <= ar.EARLY_STEPS else 0.5, "zero_variance_fraction": 0.25}
             for i in range(1, 2 * ar.EARLY_STEPS + 1)]
    d = ar.dynamics(steps)
    assert d["entropy_early"] == pytest.approx(1.0) and d["entropy_all"] == pytest.approx(0.75)
    assert d["zero_variance_fraction_all"] == pytest.approx(0.25)
    assert d["clip_frac_low_early"] is None  # a metric the steps do not carry
    runs = {"S": [fake([(0, 0.3)]) | {"dynamics": d}, fake([(0, 0.3)]) | {"dynamics": ar.dynamics(steps[:5])}],
            "P v1 inflight": [fake([(0, 0.3)])]}  # results written before the dynamics: none
    table = ar.dynamics_table(runs)
    assert table["S"]["entropy_all"] == pytest.approx((0.75 + 1.0) / 2)  # the median of the two repeats
    assert table["P v1 inflight"]["entropy_all"] is None


STAT = """cpu  {u} 0 {sy} {i} 10 0 5 {st} 0 0
cpu0 {u} 0 {sy} {i} 10 0 5 {st} 0 0
cpu1 {u} 0 {sy} {i} 10 0 5 {st2} 0 0
intr 123 0 0
"""


def test_cpu_steal_is_the_largest_share_of_one_cpus_time_the_host_took() -> None:
    """A repeat during a burst of steal (the host running another guest on our virtual CPUs) is slower for no
    reason of its own: the report names it."""
    before = read_ticks(STAT.format(u=100, sy=50, i=800, st=5, st2=5))
    after = read_ticks(STAT.format(u=160, sy=60, i=870, st=15, st2=65))  # cpu1: 60 of 200 ticks stolen
    assert before == {0: (970, 5, 810), 1: (970, 5, 810)}  # (all, steal, idle + iowait); "cpu" is not a CPU
    assert stolen(before, after) == pytest.approx(60 / 200)
    assert stolen(before, after, {0}) == pytest.approx(10 / 150)
    assert stolen(before, before) is None and stolen({}, read_ticks()) is None
    assert set(read_ticks()) >= {0}  # this machine's /proc/stat
    runs = {"S": [fake([(0, 0.3)]) | {"cpu_steal": 0.01}], "P v4 between": [
        fake([(0, 0.3)]) | {"cpu_steal": 0.02}, fake([(0, 0.3)]) | {"cpu_steal": 0.3}, fake([(0, 0.3)])]}
    assert ar.held_up(runs) == ["P v4 between, repeat 2: the host took 30% of a CPU's time (steal); this "
                                "repeat's timings are not comparable with the others'"]


BURN = """import pathlib, sys, time
t = time.process_time()
while time.process_time() - t < 0.3:
    pass
pathlib.Path(sys.argv[1]).write_text("burnt")
time.sleep(60)
"""


def test_a_roles_cpu_counts_its_whole_process_tree(tmp_path: Path) -> None:
    """A producer's CPU is mostly its vLLM engine's, in processes it started: a role's figure is its tree's."""
    import signal
    import subprocess
    import sys
    import time

    flag = tmp_path / "flag"
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', "
                              "sys.argv[1], sys.argv[2]])", BURN, str(flag)], start_new_session=True)
    try:
        before = cpu_use.tree_ticks({"role": child.pid, "gone": 2 ** 22 + 1})
        deadline = time.monotonic() + 60
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        after = cpu_use.tree_ticks({"role": child.pid})
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    assert flag.exists() and before["gone"] == 0
    assert (after["role"] - before["role"]) * cpu_use.TICK_S >= 0.25  # the grandchild's 0.3 s of CPU


def test_cpus_by_role_split_the_machines_busy_time(tmp_path: Path) -> None:
    t = cpu_use.TICK_S
    before = cpu_use.Reading(at=0.0, machine={0: (1000, 0, 600), 1: (1000, 10, 800)}, roles={"learner": 100})
    after = cpu_use.Reading(at=2.0, machine={0: (1200, 0, 650), 1: (1200, 30, 830)}, roles={"learner": 200})
    # busy: 150 ticks on cpu0, 200 - 20 stolen - 30 idle = 150 on cpu1; the learner 100 of them
    assert cpu_use.cpus_by_role(before, after) == pytest.approx({"learner": 100 * t / 2, "rest": 200 * t / 2})
    restarted = cpu_use.Reading(at=2.0, machine=after.machine, roles={"learner": 40, "feeder": 9})
    assert cpu_use.cpus_by_role(before, restarted) == pytest.approx({"rest": 300 * t / 2})  # not comparable
    assert cpu_use.role_pids(tmp_path) == {}
    (tmp_path / "children.json").write_text('{"learner": {"pid": 12, "restarts": 0}, "feeder": {"pid": null}}')
    assert cpu_use.role_pids(tmp_path) == {"learner": 12}
    assert cpu_use.read({"me": os.getpid()}).roles["me"] > 0


def test_the_seconds_a_producer_was_held_back_are_read_per_reason_and_reported(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    scrape = ("# HELP grpo_stream_producer_tokens_total Tokens generated\n"
              "grpo_stream_producer_tokens_total 1234.0\n"
              'grpo_stream_producer_paused_seconds_total{reason="backlog"} 3.5\n'
              'grpo_stream_producer_paused_seconds_total{reason="version_lag"} 0.25\n'
              "grpo_stream_producer_paused_seconds_created 1.7e+09\n")
    found = ab.producer_metrics(scrape)
    assert found[ab.HELD + ":backlog"] == 3.5 and found[ab.HELD + ":version_lag"] == 0.25
    assert found["grpo_stream_producer_tokens_total"] == 1234.0
    start = {ab.HELD + ":backlog": 1.5, "grpo_stream_producer_starved_seconds_total": 1.0}
    end = {**found, "grpo_stream_producer_starved_seconds_total": 3.0}
    assert ab.held_back(end, start, 10.0, starved_counted=True) == {"backlog": 0.2, "version_lag": 0.025,
                                                                     "no_prompts": 0.2}
    assert ab.held_back(end, start, 10.0, starved_counted=False) == {"backlog": 0.2, "version_lag": 0.025}
    runs = {"S": [fake([(0, 0.3)], gen_s=1, train_s=1)],
            "P v1 inflight": [{**fake([(0, 0.3)]), "held_back": {"backlog": b}} for b in (0.1, 0.3, 0.2)]}
    summary = ar.report(runs, 0.6, tmp_path)
    assert summary["held_back"] == {"S": {}, "P v1 inflight": {"backlog": 0.2}}
    assert "P v1 inflight: backlog 0.200" in capsys.readouterr().out


def test_the_report_names_each_repeat_the_machine_held_up(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    runs = {"S": [fake([(0, 0.3), (4, 0.6), (5, 0.6)], 1.0, 1.0) | {"cpu_steal": 0.004}],
            "P v1 inflight": [fake([(0, 0.3), (2, 0.6), (3, 0.6)]) | {"cpu_steal": STEAL_WARN * 2}],
            "P v4 between": [fake([(0, 0.3)]) | {"dynamics": {"cpu_share_all": 0.95}},
                             fake([(0, 0.3)]) | {"dynamics": {"cpu_share_all": 0.04}}]}
    summary = ar.report(runs, 0.6, tmp_path)
    assert summary["arms"]["P v1 inflight"]["runs"][0]["cpu_steal"] == STEAL_WARN * 2
    assert summary["arms"]["S"]["median"]["cpu_steal"] == 0.004
    assert [r["learner_cpu_share"] for r in summary["arms"]["P v4 between"]["runs"]] == [0.95, 0.04]
    out = capsys.readouterr().out
    assert "P v1 inflight, repeat 1: the host took 10%" in out
    assert "P v4 between, repeat 2: the learner had a CPU for 4% of its step time" in out
    assert "P v4 between, repeat 1" not in out and "S, repeat" not in out
    assert "CPUs used while the clock ran" not in out  # results without the figures (older JSON): no table
    runs["S"][0]["cpu_by_role"] = {"S": 1.9, "rest": 0.02}
    runs["P v1 inflight"][0]["cpu_by_role"] = {"producer-0": 0.9, "learner": 0.5, "rest": 0.3}
    summary = ar.report(runs, 0.6, tmp_path)
    assert summary["cpu_by_role"]["P v1 inflight"] == {"learner": 0.5, "producer-0": 0.9, "rest": 0.3}
    out = capsys.readouterr().out
    assert "  P v1 inflight: producer-0 0.90, learner 0.50, rest 0.30" in out and "  S: S 1.90, rest 0.02" in out


def test_arms_are_picked_by_name_or_slug_and_a_run_without_s_reports_no_ratios(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert ab.pick_arms(False, None) == ab.ARMS and ab.pick_arms(True, None) == ab.SHORT_ARMS
    picked = ab.pick_arms(False, "P-v1-between, p v1 inflight")
    assert [a.name for a in picked] == ["P v1 between", "P v1 inflight"]
    with pytest.raises(SystemExit, match="unknown arm.*P-v9"):
        ab.pick_arms(False, "S,P-v9")
    summary = ar.report({"P v1 inflight": [fake([(0, 0.3), (2, 0.6), (3, 0.6)])]}, 0.6, tmp_path)
    assert summary["ideal_ratio"] is None and summary["best_pipeline_ratio"] is None
    assert summary["arms"]["P v1 inflight"]["median"]["time_to_target_s"] == 2
    assert "no arm S in this run" in capsys.readouterr().out


def test_the_target_counts_when_two_evaluations_in_a_row_reach_it() -> None:
    # (second, reward, step): a lone spike at 2 s and an unconfirmed last point are not the target reached
    curve = [(0, 0.3, 0), (2, 0.62, 5), (4, 0.5, 9), (6, 0.61, 14), (8, 0.7, 19), (10, 0.4, 24), (12, 0.9, 29)]
    assert ar.time_to(curve, 0.6) == 6 and ar.steps_to(curve, 0.6) == 14
    assert ar.time_to(curve, 0.8) is None and ar.steps_to(curve, 0.8) is None
    assert ar.steps_to([(0, 0.7), (1, 0.7)], 0.6) is None  # curves without steps (older JSON) still time


@pytest.mark.slow
def test_a_short_run_measures_both_kinds_of_arm(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("vllm")
    assert ab.main(budget_s=12, short=True, target=0.99, out=str(tmp_path / "b")) == 0
    out = capsys.readouterr().out
    assert all(field in out for field in ar.FIELDS) and "best pipeline ratio to S" in out
    summary = json.loads((tmp_path / "b" / "async.json").read_text())
    assert set(summary["arms"]) == {"S", "P v1 inflight"}
    assert summary["arms"]["S"]["runs"][0]["steps"] >= 1 and summary["sync_warmup_s"] > 0  # S's untimed batch
    assert summary["sync_gen_s"] > 0 and summary["sync_train_s"] > 0 and 0.5 <= summary["ideal_ratio"] < 1
    for name, arm in summary["arms"].items():
        row = arm["runs"][0]
        assert set(row) == set(ar.FIELDS)
        assert row["steps"] >= 1 and row["tokens_per_s"] > 0, (name, row)
        assert 0 < row["engine_busy"] <= 1 and 0 < row["learner_busy"] <= 1, (name, row)
        curve = summary["curves"][name][0]
        assert len(curve) >= 2 and curve[0][0] <= 1.0, (name, curve)  # the first version, then later ones
        assert curve[0][2] == 0 and 1 <= curve[-1][2] <= row["steps"] + 1, (name, curve)  # each point's step
        dyn = summary["dynamics"][name]  # the learner's own per-step metrics, from both kinds of arm
        assert dyn["entropy_all"] > 0 and 0 <= dyn["zero_variance_fraction_all"] <= 1, (name, dyn)
        assert dyn["cpu_share_all"] > 0, (name, dyn)  # the learner step's own CPU clock, both kinds of arm
        assert 0 <= dyn["reward_mean_early"] <= 1, (name, dyn)
    assert summary["arms"]["P v1 inflight"]["runs"][0]["mean_staleness"] >= 0
    assert (tmp_path / "b" / "async.png").is_file()


def test_a_one_token_task_is_refused_before_anything_runs(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "async.json").write_text("{}")  # the last run's results
    with pytest.raises(SystemExit, match="copy_short"):  # time-to-target is read off the positions reward
        ab.main(task="last_digit", out=str(tmp_path / "b"))
    assert (tmp_path / "b" / "async.json").is_file()
    assert ab.TASK == "copy_short" and "copy_short" in ab.base_config(
        Path("m"), tmp_path, ab.ARMS[0], 10).feeder["synthetic"]["tasks"]


@pytest.mark.parametrize("lag", [0, 2])
def test_the_sync_loop_trains_each_batch_lag_versions_after_the_weights_that_generated_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lag: int) -> None:
    """S (lag 0) and S-lag2's loop with a stand-in engine and the real trainer on the tiny model: step k trains the
    batch generated under the weights of step k - lag (the first steps: the warm start's), and says so. The engine
    is driven from the generation CPUs (as the pipeline's pinned producer drives its own), the trainer runs on the
    learner's."""
    import numpy as np
    from transformers import AutoTokenizer

    from grpo_core.config import build
    from grpo_learner.config import LearnerConfig
    from grpo_producers.backends.base import Sample
    from grpo_producers.config import ProducerConfig
    from grpo_stream.bench import async_sync
    from grpo_stream.run import role_configs
    from grpo_stream.tiny_model import build_tiny_model
    from grpo_verifiers.config import VerifierConfig
    from grpo_verifiers.rewards.registry import Plan

    model = build_tiny_model(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(model)
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    roles = role_configs(ab.base_config(model, tmp_path / "o", ab.EXTRA_ARMS[0], 2.0), "unused:9092")

    every = os.sched_getaffinity(0)
    gen_cpus = {min(every)}
    placed: set[tuple[str, frozenset[int]]] = set()  # (what ran, on which CPUs)

    class Engine:  # each batch's logprobs say how many weight loads it was generated after
        loads = 0

        def generate(self, prompts: list, g: int, sampling: object) -> list:
            placed.add(("generate", frozenset(os.sched_getaffinity(0))))
            rng = np.random.default_rng(self.loads)
            samples = [np.asarray([*rng.choice(digits, int(rng.integers(1, 4))), tok.eos_token_id], np.int32)
                       for _ in range(len(prompts) * g)]
            stamp = -0.01 * (self.loads + 1)
            return [[Sample(t, np.full(len(t), stamp, np.float32), "stop", "") for t in samples[i * g:(i + 1) * g]]
                    for i in range(len(prompts))]

        def load_weights(self, path: Path) -> Path:
            placed.add(("load_weights", frozenset(os.sched_getaffinity(0))))
            self.loads += 1
            return path

    trained: list[tuple[int, int]] = []  # (policy version on the groups, weight loads behind their samples)

    class Recording(async_sync.Trainer):
        def train_step(self, groups: list) -> object:
            c = groups[0].completions[0]
            trained.append((groups[0].policy_version, round(-float(c.behaviour_logprobs[0]) / 0.01) - 1))
            placed.add(("train_step", frozenset(os.sched_getaffinity(0))))
            return super().train_step(groups)

    pcfg, lcfg = build(ProducerConfig, roles["producer"], "producer"), build(LearnerConfig, roles["learner"], "learner")
    score = async_sync.Scorer(Plan(build(VerifierConfig, roles["verifier"], "verifier").rewards), ["copy_short"])
    monkeypatch.setattr(async_sync, "Trainer", Recording)
    res = async_sync._loop(Engine(), pcfg, lcfg, score, (300.0, 4), tmp_path / "out", 4, lag, (gen_cpus, every))
    assert os.sched_getaffinity(0) == every
    assert placed == {("generate", frozenset(gen_cpus)), ("load_weights", frozenset(gen_cpus)),
                      ("train_step", frozenset(every))}
    assert res.steps == len(trained) == len(res.step_metrics) == len(res.step_ends) == 4  # max_steps ends it
    # the warm-up loaded the weights once: step k's batch came after 1 + max(0, k - lag) loads, labelled as such
    assert trained == [(max(0, k - lag), 1 + max(0, k - lag)) for k in range(len(trained))]
