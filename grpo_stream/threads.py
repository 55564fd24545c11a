"""How many compute threads each child of a run gets (``RunConfig.threads``): the CPUs, shared out.

torch computes on OpenMP threads, one per core it sees by default. Five processes of a run on a 2-core machine
(two producers, the learner, a verifier, the broker) then hold far more busy threads than there are cores, and an
OpenMP region is as slow as its slowest thread: a thread that lost its core makes the others spin-wait at the
region's barrier, so a process with more threads than its share of the cores is slower than one with its share
(the demo pipeline's figures: docs/results/2026-12-07-throughput.md). So each process computes on its share of
the cores and no more.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

COMPUTE_ROLES = ("producer", "learner")  # the roles that run torch; the verifier and the feeder get 1 thread
ENV = "OMP_NUM_THREADS"


class RunConfig(Protocol):
    """What the rule reads of ``grpo_stream.run.RunConfig`` (a protocol: the supervisor imports this module)."""

    cpus: dict[str, list[int]]
    threads: dict[str, int]
    learner_ranks: int
    feeder: dict[str, Any]
    producers: Any  # RoleCount
    verifiers: Any


def processes(cfg: RunConfig, role: str) -> int:
    """How many processes of ``role`` the run starts on this machine (learner ranks count each)."""
    return {"producer": cfg.producers.count, "verifier": cfg.verifiers.count,
            "learner": cfg.learner_ranks, "feeder": 1 if cfg.feeder else 0}[role]


def child_threads(cfg: RunConfig, machine: set[int] | None = None) -> dict[str, int]:
    """Threads per process of each role, by THE rule: a role named in ``cfg.threads`` gets that; a role pinned
    to CPUs (``cfg.cpus``) shares them among its processes; the producers and learner ranks that are not pinned
    share the CPUs nobody is pinned to; everything else, and any share below one, gets 1."""
    machine = machine if machine is not None else os.sched_getaffinity(0)
    pinned = {c for cpus in cfg.cpus.values() for c in cpus}
    free = (machine - pinned) or machine
    unpinned = sum(processes(cfg, r) for r in COMPUTE_ROLES if r not in cfg.cpus)
    out: dict[str, int] = {}
    for role in ("feeder", "producer", "verifier", "learner"):
        if role in cfg.threads:
            out[role] = cfg.threads[role]
        elif role not in COMPUTE_ROLES:
            out[role] = 1
        elif role in cfg.cpus:
            out[role] = max(1, len(cfg.cpus[role]) // max(1, processes(cfg, role)))
        else:
            out[role] = max(1, len(free) // max(1, unpinned))
    return out


def child_env(cfg: RunConfig, role: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment variables a child of ``role`` starts with on top of the supervisor's: its thread count,
    unless the supervisor's own environment already sets one and ``cfg.threads`` does not name the role (an
    operator's explicit OMP_NUM_THREADS is kept)."""
    environ = os.environ if environ is None else environ
    if ENV in environ and role not in cfg.threads:
        return {}
    return {ENV: str(child_threads(cfg)[role])}
