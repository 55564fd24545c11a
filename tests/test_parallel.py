"""The data-parallel learner (learner/parallel.py): two ranks (gloo, CPU, float32) train a batch exactly as one
process does -- same loss, same reduced gradients, same parameters after the optimizer step -- under DDP and FSDP2
and for every loss aggregation; the token-balanced split and the shard plan keep their promises."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import parallel_worker as worker
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_core.config import ConfigError, load_config
from grpo_learner import parallel
from grpo_learner.advantages import group_advantages
from grpo_learner.batching import collate
from grpo_learner.config import LearnerConfig, ParallelConfig
from grpo_learner.manifest import verify
from grpo_learner.trainer import Trainer, load_model
from grpo_stream.tiny_model import build_tiny_model

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = ("ddp", "fsdp2")  # torch 2.13's fully_shard runs on CPU with gloo


@given(st.lists(st.integers(1, 500), max_size=60), st.integers(1, 8))
@settings(max_examples=200, deadline=None)
def test_token_balanced_split_differs_by_at_most_one_sequence(lengths: list[int], world: int) -> None:
    parts = parallel.token_balanced_split(lengths, world)
    assert len(parts) == world
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))  # every row once
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths, default=0)


@pytest.mark.parametrize("world", [1, 2, 3, 7, 40])
def test_shard_plan_sends_every_counted_row_once_with_equal_micro_counts(world: int) -> None:
    groups = worker.batch_groups(groups=6)
    batch = collate(groups, [group_advantages(g.rewards, LearnerConfig().advantages, 1e-4) for g in groups], 0)
    batch.completion_mask[batch.group_index == 5] = 0.0  # eq. 8 masks the zero-variance group
    shards = parallel.plan_shards(batch, world, 64)
    assert len(shards) == world and len({len(s.micro) for s in shards}) == 1
    sent = [int(r) for s in shards for mb, pad in zip(s.micro, s.padding, strict=True) if not pad
            for r in mb.source_rows]
    masked = set((batch.group_index == 5).nonzero().flatten().tolist())
    assert sorted(sent) == sorted(set(range(batch.num_rows)) - masked)  # masked rows carry no gradient: not sent
    assert all(s.rows == batch.num_rows and s.tokens == batch.num_tokens for s in shards)
    assert all(mb.num_tokens > 0 for s in shards for mb in s.micro)  # every pass has a gradient path
    rows = sum(mb.num_rows for s in shards for mb, pad in zip(s.micro, s.padding, strict=True) if not pad)
    tokens = sum(mb.num_tokens for s in shards for mb, pad in zip(s.micro, s.padding, strict=True) if not pad)
    # The rule's weights over every rank's micro-batches: the token mean's sum to 1, the sequence means' to the
    # share of rows that were sent (the masked rows' share is their zero loss).
    assert sum(parallel.share("token_mean", 0, mb.num_tokens, batch.num_rows, tokens)
               for s in shards for mb, pad in zip(s.micro, s.padding, strict=True) if not pad) == pytest.approx(1.0)
    assert sum(parallel.share("seq_mean_token_mean", mb.num_rows, 0, batch.num_rows, tokens)
               for s in shards for mb, pad in zip(s.micro, s.padding, strict=True) if not pad) == pytest.approx(
        rows / batch.num_rows)


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One torchrun launch (2 ranks, gloo) trains every case under both strategies (~30 s here)."""
    tmp = tmp_path_factory.mktemp("parallel")
    model_dir = build_tiny_model(tmp / "model")
    out = tmp / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).parent / "parallel_worker.py"), str(model_dir), str(out), *STRATEGIES]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return model_dir, out


@pytest.mark.parametrize("case", list(worker.CASES))
@pytest.mark.slow  # two gloo ranks: the fast lane stays under 5 min
def test_two_ranks_equal_one_process(two_rank_results: tuple[Path, Path], case: str) -> None:
    """The reference is one process on the whole batch in one micro-batch: the ranks' split (and the single
    process's own micro-batching) must not change the step."""
    model_dir, out = two_rank_results
    cfg = worker.config(model_dir, "none", case, micro_batch_tokens=100_000)
    trainer = Trainer(cfg, load_model(cfg.model))
    stats = trainer.train_step(worker.batch_groups())
    grads = {n: p.grad for n, p in trainer.model.named_parameters()}
    params = trainer.full_weights()
    initial = load_model(cfg.model).state_dict()
    assert max((params[n] - initial[n]).abs().max() for n in params) > 5e-4  # the step moved the weights
    for strategy in STRATEGIES:
        got = torch.load(out / f"{strategy}-{case}.pt")
        assert got["loss"] == pytest.approx(stats.metrics["loss"], rel=1e-5, abs=1e-7), strategy
        assert got["metrics"]["kl"] == pytest.approx(stats.metrics["kl"], rel=1e-5, abs=1e-7), strategy
        assert got["metrics"]["grad_norm"] == pytest.approx(stats.metrics["grad_norm"], rel=1e-5), strategy
        assert set(got["params"]) == set(params)
        for name, g in grads.items():
            torch.testing.assert_close(got["grads"][name], g, rtol=0, atol=1e-6, msg=f"{strategy} grad {name}")
        for name, p in params.items():
            assert (got["params"][name] - p).abs().max() <= 1e-5, f"{strategy} {name}"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.slow  # two gloo ranks: the fast lane stays under 5 min
def test_a_sharded_checkpoint_restores_the_step_exactly(two_rank_results: tuple[Path, Path], strategy: str) -> None:
    _, out = two_rank_results
    got = torch.load(out / f"{strategy}-resume.pt")
    (loss_a, weights_a), (loss_b, weights_b) = got["written"], got["restored"]
    assert loss_a == loss_b
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    ckpt = out / f"ckpt-{strategy}" / "step-00000001"
    assert sorted(p.name for p in ckpt.iterdir()) == ["dcp", "manifest.json", "meta.json", "rng", "trainer.pt"]
    assert verify(ckpt) == ""  # the shards are in the integrity manifest too
    assert any(name.startswith("dcp/") for name in json.loads((ckpt / "manifest.json").read_text())["files"])
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rank-0.pt", "rank-1.pt"]
    assert (out / f"ckpt-{strategy}" / "latest").read_text() == "step-00000001"


def test_a_one_process_learner_does_not_import_the_sharded_checkpoint_code() -> None:
    """torch.distributed.checkpoint costs 0.5-0.9 s of CPU at every learner start; only ranks > 1 use it (and the
    sharded checkpoint test above shows it is still there when they do)."""
    code = "import sys, grpo_learner.service; print('torch.distributed.checkpoint' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_config_is_checked_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="mixed_precision: bfloat16 needs strategy fsdp2"):
        ParallelConfig(strategy="ddp", mixed_precision="bfloat16").validate()
    with pytest.raises(ConfigError, match="cpu_offload: offloads from a GPU"):
        load_config(LearnerConfig, None, ["model.path=x", "parallel.strategy=fsdp2", "parallel.cpu_offload=true"])
    with pytest.raises(ConfigError, match="set model.dtype=float32"):
        load_config(LearnerConfig, None, ["model.path=x", "parallel.strategy=fsdp2", "model.dtype=bfloat16",
                                          "parallel.mixed_precision=bfloat16"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="set parallel.strategy=ddp"):
        parallel.setup(ParallelConfig(), "cpu")


def _rank_pids(torchrun_pid: int) -> dict[int, int]:
    """RANK -> pid of torchrun's worker processes (its children with RANK in their environment)."""
    out = {}
    for task in Path(f"/proc/{torchrun_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            with contextlib.suppress(OSError):
                env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
                if "RANK" in env:
                    out[int(env["RANK"])] = int(pid)
    return out


@pytest.mark.slow
@pytest.mark.integration
def test_a_two_rank_learner_in_a_pipeline_survives_a_rank_killed(tmp_path: Path) -> None:
    """The whole pipeline through a real broker (feeder, an HF producer, a verifier) with a 2-rank DDP learner under
    torchrun: it trains, publishes weights the producer swaps in (groups of versions > 0 are trained), and after
    a kill -9 of rank 1 torchrun restarts both ranks, the learner resumes from its newest checkpoint and the
    lineage holds every groups offset it accounted for exactly once."""
    from grpo_stream.demo_model import warm_start

    # Warm-started like the demo's: groups with reward variance, so the ranks have tokens to train on.
    model = warm_start(build_tiny_model(tmp_path / "tiny"), "last_digit", seed=0, out_dir=tmp_path / "model")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "grpo_stream.cli", "run", str(REPO / "configs" / "demo.yaml"), "name=dp-test",
           f"out_dir={out}", "max_minutes=6", "learner_ranks=2", "learner.parallel.strategy=ddp",
           "learner.max_steps=12", "learner.groups_per_batch=4", "learner.publish_every=2",
           "learner.checkpoint_every=2",
           f"learner.model.path={model}", f"producers.config.backend.model={model}", "producers.count=1",
           f"learner.weights.fs.root={out / 'weights'}", f"producers.config.weights.fs.root={out / 'weights'}",
           "producers.config.max_backlog_groups=8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, killed = time.monotonic() + 300, None
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = out / "metrics.jsonl"
        if killed is None and metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            ranks = _rank_pids(json.loads((out / "children.json").read_text())["learner"]["pid"])
            killed = ranks[1]
            os.kill(killed, signal.SIGKILL)  # mid-run: steps past the last checkpoint die with it
        time.sleep(0.5)
    output, _ = proc.communicate(timeout=120)
    assert killed is not None and proc.returncode == 0, output[-4000:]
    log = (out / "logs" / "learner.log").read_text()
    assert "failed (exitcode: -9) local_rank: 1" in log and "resumed from" in log, log[-3000:]  # restarted

    lines = [json.loads(x) for x in (out / "lineage.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines if not line.get("no_update")]
    assert steps == list(range(1, 13)), steps
    seen = [(e["partition"], e["offset"]) for line in lines for e in line["trained"] + line["dropped"]]
    assert len(seen) == len(set(seen)), "an offset accounted for twice"
    position = json.loads((out / "checkpoints" / "step-00000012" / "meta.json").read_text())["offsets"]
    for part, end in position.items():  # every offset below the final checkpoint's position, once
        assert sorted(o for p, o in seen if p == int(part)) == list(range(end)), part
    trained = [e["group_id"] for line in lines for e in line["trained"]]
    assert len(trained) == len(set(trained)) == 12 * 4
    assert max(e["version"] for line in lines for e in line["trained"]) >= 2  # the producer swapped weights in
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["grad_norm"] > 0 for m in metrics) >= 6  # the ranks trained on real gradients
    assert json.loads((out / "checkpoints" / "step-00000012" / "meta.json").read_text())["layout"] == "dcp"
