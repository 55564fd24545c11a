"""The rewards library: built-in rewards, combination and task selection, and the sandbox pool's failure handling.

Pool workers import the misbehaving rewards of ``tests/reward_fixtures.py`` by dotted path (``tests/`` is on
``sys.path`` under pytest, and spawned workers inherit the parent's path).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from grpo_core.config import ConfigError, build
from grpo_verifiers.rewards import RewardConfig, RewardPool, RewardRequest, RewardTerm, check_request, failures
from grpo_verifiers.rewards.builtins import BUILTINS, exact, format_reward, overlong, positions, regex, resolve
from grpo_verifiers.rewards.math_reward import gold_text, last_boxed, math_answer
from grpo_verifiers.rewards.registry import Plan, judge

FX = "reward_fixtures"

# ------------------------------------------------------------------------------------------ math

GSM8K_GOLD = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
MATH_CASES = [
    # (gold, completion, expected)
    ("72", "72", 1.0),
    ("72", "The answer is 72.", 1.0),
    ("72", "So the total is \\boxed{72}", 1.0),
    ("72", "72.0", 1.0),
    ("72", "73", 0.0),
    ("72", "I think it is 7200", 0.0),
    ("1000", "1,000", 1.0),
    ("1,000", "She has 1000 dollars", 1.0),
    ("\\frac{1}{2}", "0.5", 1.0),
    ("0.5", "$\\frac{1}{2}$", 1.0),
    ("3/4", "\\boxed{\\frac{3}{4}}", 1.0),
    ("3/4", "\\boxed{\\frac{4}{3}}", 0.0),
    ("$5", "It costs $5.", 1.0),
    ("\\boxed{72}", "72", 1.0),
    (GSM8K_GOLD, "48/2 = 24 in May, so 48 + 24 = 72. The answer is 72", 1.0),
    (GSM8K_GOLD, "48/2 = 24 in May, so 48 + 24 = 70", 0.0),
    ("72", "First \\boxed{70}, wait, no: \\boxed{72}", 1.0),  # the last box counts
    ("72", "\\boxed{72}? No: \\boxed{70}", 0.0),
    ("-3", "x = \u22123", 1.0),  # unicode minus
    ("2\\sqrt{3}", "\\boxed{\\sqrt{12}}", 1.0),
    ("x+1", "\\boxed{1 + x}", 1.0),
    ("72", "I do not know", 0.0),
    (["72", "seventy-two"], "\\boxed{72}", 1.0),  # a list of acceptable answers
]


@pytest.mark.parametrize(("gold", "completion", "expected"), MATH_CASES)
def test_math_reward_table(gold: Any, completion: str, expected: float) -> None:
    reward, info = math_answer(completion, "q", {"answer": gold})
    assert reward == expected, info


def test_math_helpers() -> None:
    assert gold_text(GSM8K_GOLD) == "72"
    assert gold_text("$1,000") == "1000"
    assert gold_text("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed("cut off \\boxed{\\frac{1}{2}") is None
    with pytest.raises(ValueError, match="no 'answer'"):
        math_answer("72", "q", {})


# ------------------------------------------------------------------------------------------ exact, regex, format


@pytest.mark.parametrize(("completion", "expected"), [
    ("7", 1.0), ("7\nbecause max", 1.0), (" 7 ", 1.0), ("7<|endoftext|>", 1.0), ("7</s>junk", 1.0),
    ("72", 0.0), ("7.", 0.0), ("<|endoftext|>", 0.0), ("x 7", 0.0),
])
def test_exact_token_mode_for_the_synthetic_tasks(completion: str, expected: float) -> None:
    assert exact(completion, "max(3,7)=", {"answer": "7"})[0] == expected


def test_exact_modes_and_lists() -> None:
    assert exact("Paris is big\nyes", "", {"answer": "Paris is big"}, mode="line")[0] == 1.0
    assert exact("  Paris is big  ", "", {"answer": "Paris is big"}, mode="full")[0] == 1.0
    assert exact("PARIS", "", {"answer": "paris"}, case_sensitive=False)[0] == 1.0
    assert exact("PARIS", "", {"answer": "paris"})[0] == 0.0
    assert exact("b", "", {"answer": ["a", "b"]})[0] == 1.0


@pytest.mark.parametrize(("completion", "expected"), [
    ("3847", 1.0), ("3841", 0.75), ("38", 0.5), ("38470", 0.8), ("", 0.0), ("3847<|endoftext|>", 1.0),
    (" 3847\nmore", 1.0), ("7483", 0.0), ("x3847", 0.0),
])
def test_positions_gives_partial_credit_per_character_in_place(completion: str, expected: float) -> None:
    assert positions(completion, "copy(3847)=", {"answer": "3847"})[0] == pytest.approx(expected)


def test_positions_lists_case_and_registry() -> None:
    assert positions("ab", "", {"answer": ["xb", "ab"]})[0] == 1.0
    assert positions("AB", "", {"answer": "ab"})[0] == 0.0
    assert positions("AB", "", {"answer": "ab"}, case_sensitive=False)[0] == 1.0
    assert BUILTINS["positions"].inline_safe


@pytest.mark.parametrize(("chars", "expected"), [(0, 1.0), (32, 1.0), (80, 0.5), (128, 0.0), (500, 0.0)])
def test_overlong_is_dapos_soft_punishment_in_characters(chars: int, expected: float) -> None:
    # max 128, buffer 96: full reward up to 32 characters, then linear down to 0 at 128.
    assert overlong("x" * chars, "", {}, max_chars=128, buffer_chars=96)[0] == pytest.approx(expected)


def test_overlong_params_are_checked_and_it_runs_inline() -> None:
    assert overlong("x" * 11, "", {}, max_chars=10)[0] == 0.0  # no buffer: a hard cut
    assert BUILTINS["overlong"].inline_safe
    with pytest.raises(ValueError, match="buffer_chars"):
        BUILTINS["overlong"].check(max_chars=10, buffer_chars=11)
    with pytest.raises(ValueError, match="max_chars"):
        BUILTINS["overlong"].check(max_chars=0)
    plan = Plan(RewardConfig(by_task={"t": [RewardTerm("overlong", params={"max_chars": 4})]}))
    assert plan.score_here("t", "abcd", "", {}) == 1.0 and plan.score_here("t", "abcde", "", {}) == 0.0
    assert plan.score_here("nothing covers this", "abc", "", {}) == 0.0


def test_regex_and_format() -> None:
    assert regex("answer: 42", "", {}, pattern=r"\d+") == 1.0
    assert regex("answer: 42", "", {}, pattern=r"\d+", mode="fullmatch") == 0.0
    assert regex(" 42\n", "", {"pattern": r"\d+"}, mode="fullmatch") == 1.0
    assert regex("ABC", "", {}, pattern="abc", flags="i") == 1.0
    with pytest.raises(ValueError, match="no pattern"):
        regex("x", "", {})
    good = "<think>hmm</think>\n<answer>7</answer>"
    assert format_reward(good, "", {})[0] == 1.0
    assert format_reward("<think>hmm</think>", "", {})[0] == 0.0
    assert format_reward("<think>hmm</think>", "", {}, mode="fraction")[0] == 0.5
    assert format_reward("<answer>7</answer><think>x</think>", "", {}, mode="fraction")[0] == 0.5  # order
    assert format_reward("<answer>7</answer><think>x</think>", "", {}, ordered=False)[0] == 1.0
    assert format_reward("chatter " + good, "", {}, strict=True)[0] == 0.0
    assert format_reward(good + "<|endoftext|>", "", {}, strict=True)[0] == 1.0


def test_judge_values() -> None:
    assert judge(1).reward == 1.0 and judge(True).reward == 1.0
    assert judge((0.5, {"a": 1})).info == {"a": 1}
    assert judge(float("inf")).error == "non_finite"
    assert judge(-0.1).error == "out_of_range"
    assert judge("1").error == "bad_result: str"
    assert "info_dropped" in judge((1.0, {"x": object()})).info


# ------------------------------------------------------------------------------------------ config


def test_config_from_yaml_shape_and_validation() -> None:
    cfg = build(RewardConfig, {"by_task": {"gsm8k": [{"name": "math", "weight": 9}, {"name": "format"}]},
                               "workers": 1}, "reward.")
    cfg.validate()
    assert cfg.by_task["gsm8k"][0] == RewardTerm("math", 9.0, {})
    assert cfg.terms_for("gsm8k") is cfg.by_task["gsm8k"]
    assert cfg.terms_for("exact") == [RewardTerm("exact")]  # a task named like a built-in
    assert cfg.terms_for("other") is None
    bad = [
        ({"inline_trusted": ["regex"]}, "may not run inline"),
        ({"by_task": {"t": [{"name": "nope"}]}}, "neither a built-in"),
        ({"by_task": {"t": [{"name": "no_such_module_xyz:f"}]}}, "No module"),
        ({"by_task": {"t": [{"name": f"{FX}:NOT_CALLABLE"}]}}, "not callable"),
        ({"by_task": {"t": [{"name": "exact", "params": {"mode": "word"}}]}}, "mode"),
        ({"by_task": {"t": [{"name": "exact", "params": {"typo": 1}}]}}, "typo"),
        ({"by_task": {"t": [{"name": "regex", "params": {"pattern": "("}}]}}, "does not compile"),
        ({"by_task": {"t": [{"name": f"{FX}:length_ratio", "params": {"wrong": 1}}]}}, "wrong"),
        ({"by_task": {"t": [{"name": "exact", "weight": 0}]}}, "all be 0"),
        ({"timeout_s": 0}, "timeout_s"),
    ]
    for raw, message in bad:
        with pytest.raises(ConfigError, match=message):
            build(RewardConfig, raw, "reward.").validate()
    assert resolve(f"{FX}:length_ratio")("12345", "", {})[0] == 0.5


# ------------------------------------------------------------------------------------------ the pool

TRIVIAL = [RewardTerm(f"{FX}:contains_answer")]
CHAOS = {
    "trivial": TRIVIAL,
    "hang": [RewardTerm(f"{FX}:sleep_forever")],
    "raise": [RewardTerm(f"{FX}:raises")],
    "alloc": [RewardTerm(f"{FX}:allocate_2gb")],
    "alloc_slow": [RewardTerm(f"{FX}:allocate_gradually")],
    "segv": [RewardTerm(f"{FX}:segfault")],
    "exit": [RewardTerm(f"{FX}:exits")],
    "nan": [RewardTerm(f"{FX}:nan")],
    "big": [RewardTerm(f"{FX}:too_big")],
    "str": [RewardTerm(f"{FX}:not_a_number")],
    "mixed": [RewardTerm("math", 0.9), RewardTerm("format", 0.1, {"tags": ["answer"]})],
    "custom": [RewardTerm(f"{FX}:length_ratio", 1.0, {"target": 4})],
    "nap": [RewardTerm(f"{FX}:nap", 1.0, {"seconds": 0.3})],
    "flaky": [RewardTerm(f"{FX}:crashes_once")],
    "hang_is_zero": [RewardTerm(f"{FX}:sleep_forever", zero_on=["timeout"])],
    "regex_bomb": [RewardTerm("regex", 1.0, {"pattern": r"(a+)+$"})],  # exponential backtracking
    "default": [RewardTerm("exact")],
}


@pytest.fixture(scope="module")
def pool() -> Iterator[RewardPool]:
    cfg = RewardConfig(by_task=CHAOS, workers=2, timeout_s=1.0, memory_mb=256, max_completion_chars=1000)
    with RewardPool(cfg) as p:
        yield p


def req(task: str, completion: str = "the answer is 7", answer: Any = "7") -> RewardRequest:
    return RewardRequest(completion, "prompt", task, {"answer": answer})


def trivial_batch(n: int) -> list[RewardRequest]:
    return [req("trivial", f"value {i}", str(i) if i % 2 else "absent") for i in range(n)]


def assert_healthy(pool: RewardPool) -> None:
    """All workers back, and a 50-record batch comes out right and fast (throughput kept)."""
    assert pool.wait_ready(30.0)
    t0 = time.monotonic()
    results = pool.score_batch(trivial_batch(50))
    assert [r.reward for r in results] == [float(i % 2) for i in range(50)]
    assert all(r.error is None for r in results)
    assert time.monotonic() - t0 < 5.0
    stats = pool.stats()
    assert stats["workers_alive"] == stats["workers_ready"] == 2


@pytest.mark.parametrize(("task", "reason", "restarts"), [
    ("hang", "timeout", 1),
    ("raise", "exception: ValueError: boom", 0),
    ("alloc", "memory", 0),
    ("alloc_slow", "memory", 0),
    ("segv", "crash: signal 11", 1),
    ("exit", "crash: exit 3", 1),
    ("nan", "non_finite", 0),
    ("big", "out_of_range", 0),
    ("str", "bad_result: str", 0),
])
def test_pool_contains_each_failure(pool: RewardPool, task: str, reason: str, restarts: int) -> None:
    """Each is an infrastructure failure: tried twice (retries=1), then failed (no score), never a 0 to train on."""
    before = pool.stats()
    [result] = pool.score_batch([req(task)])
    assert (result.reward, result.error, result.failed) == (0.0, reason, True)
    after = pool.stats()
    kind = reason.split(":", 1)[0]
    assert after["errors"][kind] == before["errors"].get(kind, 0) + 2
    assert after["worker_restarts"] == before["worker_restarts"] + 2 * restarts
    assert (after["retried"], after["failed"]) == (before["retried"] + 1, before["failed"] + 1)
    assert_healthy(pool)


def test_a_transient_failure_is_retried_and_scores(pool: RewardPool, tmp_path: Path) -> None:
    before = pool.stats()
    [result] = pool.score_batch([RewardRequest("x", "", "flaky", {"marker": str(tmp_path / "m")})])
    assert (result.reward, result.error, result.failed) == (1.0, None, False)
    after = pool.stats()
    assert after["errors"]["crash"] == before["errors"].get("crash", 0) + 1  # the first try crashed its worker
    assert (after["retried"], after["failed"]) == (before["retried"] + 1, before["failed"])
    assert_healthy(pool)


def test_a_term_may_declare_its_timeout_a_real_zero(pool: RewardPool) -> None:
    before = pool.stats()
    [result] = pool.score_batch([req("hang_is_zero")])
    assert (result.reward, result.error, result.failed) == (0.0, "timeout", False)
    assert pool.stats()["retried"] == before["retried"]  # a verdict is not retried
    assert_healthy(pool)


def test_failure_policies() -> None:
    assert [failures.policy(r) for r in ("empty", "oversized", "invalid_utf8")] == ["zero"] * 3
    assert [failures.policy(r) for r in ("timeout", "crash: signal 9", "memory", "exception: KeyError: 'a'",
                                         "non_finite", "unknown_task: x", "something_new")] == ["fail"] * 7
    assert failures.policy("timeout", frozenset({"timeout"})) == "zero"
    assert failures.policy("non_finite", frozenset({"non_finite"})) == "fail"  # only the zeroable kinds move
    assert not failures.retriable("unknown_task: x") and failures.retriable("crash: exit 3")
    with pytest.raises(ConfigError, match="zero_on"):
        RewardConfig(by_task={"t": [RewardTerm("exact", zero_on=["non_finite"])]}).validate()


def test_pool_failures_inside_a_batch_spare_the_neighbours(pool: RewardPool) -> None:
    batch = trivial_batch(20) + [req("hang"), req("segv")] + trivial_batch(20) + [req("raise")] + trivial_batch(20)
    t0 = time.monotonic()
    results = pool.score_batch(batch)
    assert time.monotonic() - t0 < 15.0
    assert [r.error for r in results[20:22]] == ["timeout", "crash: signal 11"]
    assert results[42].error == "exception: ValueError: boom"
    good = [r for i, r in enumerate(results) if i not in (20, 21, 42)]
    expected = [float(i % 2) for i in range(20)] * 3
    assert [r.reward for r in good] == expected and all(r.error is None for r in good)
    assert_healthy(pool)


def test_catastrophic_regex_is_stopped_by_the_timeout(pool: RewardPool) -> None:
    [bomb, fine] = pool.score_batch([req("regex_bomb", "a" * 64 + "!"), req("regex_bomb", "aaa")])
    assert (bomb.reward, bomb.error, fine.reward, fine.error) == (0.0, "timeout", 1.0, None)
    assert_healthy(pool)


def test_pool_runs_a_batch_on_all_workers(pool: RewardPool) -> None:
    assert pool.wait_ready(30.0)
    t0 = time.monotonic()
    results = pool.score_batch([req("nap") for _ in range(6)])
    assert [r.reward for r in results] == [1.0] * 6
    assert time.monotonic() - t0 < 1.6  # 6 x 0.3 s: 1.8 s on one worker, ~0.9 s on two


def test_pool_survives_its_own_bug(pool: RewardPool, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(queue: object) -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(pool, "_dispatch", broken)
    results = pool.score_batch([req("trivial"), req("exact", "7")])
    assert results[0].error is not None and results[0].error.startswith("pool_error: OSError")
    assert (results[1].reward, results[1].error) == (1.0, None)  # inline terms were already done
    monkeypatch.undo()
    assert_healthy(pool)


def test_pool_combination_selection_and_custom(pool: RewardPool) -> None:
    results = pool.score_batch([
        req("mixed", "<answer>\\boxed{72}</answer>", GSM8K_GOLD),  # math 1, format 1
        req("mixed", "\\boxed{72}", "72"),  # math 1, no tags
        req("mixed", "<answer>71</answer>", "72"),  # format only
        req("exact", "7<|endoftext|>"),  # a task named like a built-in
        req("unmapped", "7 is it"),  # falls to by_task["default"] (exact)
        req("custom", "abcdefgh"),  # dotted path with params: 4/8
    ])
    assert [r.reward for r in results] == pytest.approx([1.0, 0.9, 0.1, 1.0, 1.0, 0.5])
    assert results[0].info["terms"] == {"math": 1.0, "format": 1.0}
    assert results[5].info["details"] == {f"{FX}:length_ratio": {"length": 8}}
    assert all(r.error is None and r.seconds >= 0 for r in results)


def test_pool_combination_with_a_failing_term() -> None:
    cfg = RewardConfig(by_task={"t": [RewardTerm("format", 1.0, {"tags": ["a"]}), RewardTerm(f"{FX}:raises", 3.0)]},
                       workers=1, timeout_s=2.0, memory_mb=512)
    with RewardPool(cfg) as p:
        [r] = p.score_batch([RewardRequest("<a>x</a>", "", "t", {})])
    assert (r.reward, r.failed) == (0.0, True)  # a partial sum is no score: the record failed
    assert r.error == "exception: ValueError: boom"
    assert r.info["errors"] == {f"{FX}:raises": "exception: ValueError: boom"}


def test_pool_rejects_bad_inputs_without_calling_a_worker(pool: RewardPool) -> None:
    before = pool.stats()
    cases = [
        (RewardRequest(b"\xff\xfe7", "", "trivial", {"answer": "7"}), "invalid_utf8"),
        (RewardRequest("7\udcff", "", "trivial", {"answer": "7"}), "invalid_utf8"),
        (RewardRequest("7", b"\xc3(", "trivial", {"answer": "7"}), "invalid_utf8"),
        (RewardRequest("", "", "trivial", {"answer": "7"}), "empty"),
        (RewardRequest(" \n\t", "", "trivial", {"answer": "7"}), "empty"),
        (RewardRequest("7" * 1001, "", "trivial", {"answer": "7"}), "oversized"),
        (RewardRequest("7", "", "nothing", {"answer": "7"}), None),  # falls to default: fine
        (RewardRequest(None, "", "trivial", {}), "bad_input: NoneType"),  # type: ignore[arg-type]
        (RewardRequest("7", "", "trivial", "m"), "bad_input: task must be a str and metadata a dict"),  # type: ignore
    ]
    results = pool.score_batch([r for r, _ in cases])
    assert [r.error for r in results] == [reason for _, reason in cases]
    assert [r.reward for r in results] == [0.0] * 6 + [1.0, 0.0, 0.0]
    # The completion's own faults are its 0; unusable metadata is no verdict on the completion.
    assert [r.failed for r in results] == [False] * 7 + [True, True]
    after = pool.stats()
    assert after["pooled_records"] == before["pooled_records"]  # none of them reached a worker
    assert after["errors"]["invalid_utf8"] == before["errors"].get("invalid_utf8", 0) + 3
    assert check_request(RewardRequest("\u00e9".encode(), "", "t", {}), 10) == (("\u00e9", ""), None)


def test_unknown_task_without_default_and_memory_floor() -> None:
    with RewardPool(RewardConfig(workers=1, memory_mb=512)) as p:
        [r] = p.score_batch([RewardRequest("7", "", "who", {"answer": "7"})])
        assert (r.reward, r.error, r.failed) == (0.0, "unknown_task: who", True)
        [r] = p.score_batch([RewardRequest("\\boxed{0.5}", "", "math", {"answer": "\\frac12"})])
        assert (r.reward, r.error) == (1.0, None)
    with pytest.raises(ConfigError, match="memory_mb=64 leaves no room"):
        RewardPool(RewardConfig(workers=1, memory_mb=64))


def test_trl_style_reward_functions_score_as_trl_would() -> None:
    """``trl:module:function`` calls a function written for TRL's GRPOTrainer with lists (prompts, completions,
    the metadata as columns); None scores 0 without an error; ``conversational`` passes chat messages."""
    trl = f"trl:{FX}:trl_accuracy"
    cfg = RewardConfig(by_task={"plain": [RewardTerm(trl)],
                                "chat": [RewardTerm(trl, params={"conversational": True})],
                                "bad": [RewardTerm(f"trl:{FX}:trl_too_many")]}, workers=1)
    cfg.validate()
    requests = [RewardRequest("7", "p", "plain", {"answer": "7"}), RewardRequest(" 8\n", "p", "plain", {"answer": "7"}),
                RewardRequest("7", "p", "plain", {"answer": "7", "kind": "skip"}),
                RewardRequest("7", "p", "chat", {"answer": 7}), RewardRequest("7", "p", "bad", {"answer": "7"})]
    with RewardPool(cfg) as p:
        right, wrong, skipped, chat, bad = p.score_batch(requests)
    assert (right.reward, right.error, wrong.reward, wrong.error) == (1.0, None, 0.0, None)
    assert (skipped.reward, skipped.error, skipped.failed) == (0.0, None, False)
    assert skipped.info["details"][trl] == {"trl": "none"}
    assert (chat.reward, chat.error) == (1.0, None)
    assert bad.failed and "one value per completion" in (bad.error or "")


@pytest.mark.parametrize(("term", "message"), [
    (RewardTerm(f"trl:{FX}:not_trl"), "prompts"),
    (RewardTerm(f"trl:{FX}:trl_accuracy", params={"answer": 1, "prompts": 2}), "multiple values"),
    (RewardTerm(f"trl:{FX}:missing"), "AttributeError"),
])
def test_a_trl_style_term_that_cannot_be_called_fails_at_config_load(term: RewardTerm, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RewardConfig(by_task={"t": [term]}).validate()
