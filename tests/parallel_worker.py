"""One rank of tests/test_parallel.py's equivalence check, run under ``torchrun`` (gloo, CPU, float32).

``python -m torch.distributed.run --nproc-per-node 2 tests/parallel_worker.py MODEL_DIR OUT_DIR STRATEGY...``: for
every strategy and every case of ``CASES`` every rank builds the same model and trainer; rank 0 trains one learner
step on ``batch_groups()`` (the others their shares) and writes the loss, the reduced gradients and the parameters
after the optimizer step to ``OUT_DIR/<strategy>-<case>.pt``. The test computes the same step in one process.
Then a sharded checkpoint of the last case is restored into a fresh trainer (``OUT_DIR/<strategy>-resume.pt``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from grpo_core import wire
from grpo_core.config import load_config
from grpo_learner import dist_checkpoint, parallel
from grpo_learner.config import LearnerConfig
from grpo_learner.trainer import Trainer, load_model

G = 4
# Every aggregation; a proximal pass with a mis rejection (some tokens leave the token mean's denominator) and the
# reference model's KL; several micro-batches per rank (micro_batch_tokens) so ranks get different counts.
CASES: dict[str, list[str]] = {
    "seq_mean_token_mean": ["loss.agg=seq_mean_token_mean"],
    "token_mean": ["loss.agg=token_mean"],
    "seq_mean_token_sum_norm": ["loss.agg=seq_mean_token_sum_norm"],
    "token_mean_mis_kl": ["loss.agg=token_mean", "loss.variant=grpo_offpolicy_exact", "loss.is_correction=mis",
                          "loss.is_cap=1.0", "loss.beta=0.1"],
}


def config(model_dir: str | Path, strategy: str, case: str, micro_batch_tokens: int = 64) -> LearnerConfig:
    # adam_eps 1e-6 rather than 1e-8: Adam's first step g / (|g| + eps) turns float32 summation noise (~1e-8 in
    # the reduced gradients) on elements with |g| ~ eps into 1e-5-sized parameter differences.
    return load_config(LearnerConfig, None, [
        f"model.path={model_dir}", f"pipeline.group_size={G}", "pipeline.max_new_tokens=16", "optim.lr=1e-3",
        "optim.adam_eps=1e-6", f"micro_batch_tokens={micro_batch_tokens}", f"parallel.strategy={strategy}",
        *CASES[case]])


def batch_groups(seed: int = 0, groups: int = 5) -> list[wire.ScoredGroup]:
    """Groups of different lengths; the last one zero-variance (eq. 8 masks its rows)."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        gid, members = f"g{g}@e0r0", []
        for i in range(G):
            n = int(rng.integers(1, 12))
            members.append(wire.Completion(
                group_id=gid, index=i, group_size=G, prompt_id=f"g{g}", task="t",
                prompt_token_ids=rng.integers(0, 250, int(rng.integers(2, 7)), dtype=np.int32),
                completion_token_ids=rng.integers(0, 250, n, dtype=np.int32),
                behaviour_logprobs=(-5.8 + 0.3 * rng.standard_normal(n)).clip(max=-0.01).astype(np.float32),
                policy_version=0, producer_id="test", finish_reason="stop"))
        rewards = [1.0] * G if g == groups - 1 else [float(x) for x in rng.random(G)]
        out.append(wire.ScoredGroup(group_id=gid, prompt_id=f"g{g}", task="t", policy_version=0,
                                    completions=members, rewards=rewards, reward_mean=float(np.mean(rewards)),
                                    reward_std=float(np.std(rewards)), verifier_id="test", group_size=G))
    return out


def full(t: torch.Tensor) -> torch.Tensor:
    gather = getattr(t, "full_tensor", None)
    return (gather() if gather is not None else t).detach().clone()


def main(model_dir: str, out_dir: str, strategies: list[str]) -> None:
    env = None
    for strategy in strategies:
        for case in CASES:
            cfg = config(model_dir, strategy, case)
            env = parallel.setup(cfg.parallel, cfg.model.device)
            assert env is not None and env.world == 2
            trainer = Trainer(cfg, load_model(cfg.model), env)
            stats = trainer.train_step(batch_groups()) if env.leader else trainer.train_shard()
            grads = {n: full(p.grad) for n, p in trainer.model.named_parameters()}
            weights = trainer.full_weights()
            if env.leader:
                torch.save({"loss": stats.metrics["loss"], "metrics": stats.metrics, "grads": grads,
                            "params": weights}, Path(out_dir) / f"{strategy}-{case}.pt")
        resume(model_dir, Path(out_dir), strategy, trainer, env)
    parallel.teardown()


def resume(model_dir: str, out: Path, strategy: str, trainer: Trainer, env: parallel.Env) -> None:
    """A sharded checkpoint restores the step exactly: a fresh trainer loaded from it takes the same next step
    (weights, optimizer moments, scheduler) as the trainer that wrote it. Written asynchronously, while the
    trainer that wrote it already takes that step: the checkpoint holds the state of the step it was taken at."""
    root = out / f"ckpt-{strategy}"
    sharded = dist_checkpoint.ShardedSaver(env, background=True)
    finish = sharded.save(root, 1, trainer, {"seen": []}, {"offsets": {}}, keep=2)
    after = []
    stats = trainer.train_step(batch_groups(seed=1)) if env.leader else trainer.train_shard()
    after.append((stats.metrics.get("loss"), trainer.full_weights()))
    finish()
    sharded.wait()
    dist.barrier()
    fresh = Trainer(trainer.cfg, load_model(trainer.cfg.model), env)
    dist_checkpoint.load(root / "step-00000001", fresh, env)
    stats = fresh.train_step(batch_groups(seed=1)) if env.leader else fresh.train_shard()
    after.append((stats.metrics.get("loss"), fresh.full_weights()))
    if env.leader:
        torch.save({"written": after[0], "restored": after[1]}, out / f"{strategy}-resume.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
