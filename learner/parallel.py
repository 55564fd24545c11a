"""Data-parallel learning: N ranks under ``torchrun`` train each batch exactly as one process would.

Who does what: rank 0 alone talks to Kafka (the source, the admission and staleness rules, the lineage and the
offsets: ``grpo_learner.service``, unchanged). It prepares each batch (advantages, collate, eq. 8 masking), splits
it into per-rank shares balanced by token count (:func:`plan_shards`) and scatters them; every rank runs the
forward/backward passes of its share; DDP or FSDP2 averages the gradients; every rank steps its optimizer.

**The normalisation rule** (the one place; :func:`share` implements it, ``grpo_learner.trainer`` applies it).
The loss of a batch is a mean: over its sequences for the per-sequence aggregations (``seq_mean_token_mean``,
``seq_mean_token_sum_norm``) and over its counted tokens for ``token_mean`` (counted: completion tokens after eq. 8
masking and after an ``is_correction: mis`` rejection). A micro-batch's loss is the same mean over its own rows or
tokens, so it enters the batch loss with the weight *its rows / the batch's rows* or *its counted tokens / the
batch's counted tokens* -- the whole batch's denominators, whichever rank holds it and however the batch was cut
(the counted-token total is summed over the ranks before the first backward). The batch loss is the sum over every
micro-batch of every rank of ``weight * loss``. DDP and FSDP2 *average* gradients over the W ranks, so each rank
backpropagates ``W * weight * loss``: the average of the ranks' sums is the sum over all micro-batches, i.e. the
single-process gradient of the same batch (tests/test_parallel.py checks loss, gradients and the parameters after
one optimizer step, within 1e-5 in float32, for every aggregation).

Collectives must match across ranks: FSDP2 all-gathers parameters in every forward and reduce-scatters in the
last backward of a step, DDP all-reduces in the last backward. So every rank gets the same number of micro-batches
(ranks with fewer get *padding*: a copy of one real row with weight 0, which contributes zero gradient), rows
without a counted token (eq. 8 masked) are not sent at all (their gradient is zero; they still count in the
sequence mean's denominator), and a rank backpropagates even a non-finite loss (the NaN then reaches every rank's
reduced gradient and every rank skips the update together).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from grpo_core.config import ConfigError
from grpo_learner.batching import Batch, microbatches
from grpo_learner.config import ParallelConfig, Strategy
from grpo_learner.logprobs import completion_logprobs, completion_logprobs_with_entropy

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Env:
    """This process's place in the job (from torchrun's RANK / WORLD_SIZE / LOCAL_RANK)."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    strategy: Strategy

    @property
    def leader(self) -> bool:
        """Rank 0: the one that owns Kafka, the lineage and the offsets."""
        return self.rank == 0


def setup(par: ParallelConfig, device: str) -> Env | None:
    """Join the process group torchrun describes (gloo on CPU, nccl on CUDA); None for ``strategy: none``.

    Without torchrun's environment a ddp/fsdp2 learner is a world of one rank (same code, same checkpoints)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if par.strategy == "none":
        if world > 1:
            raise ConfigError(f"torchrun started {world} ranks but parallel.strategy is none: set "
                              "parallel.strategy=ddp (or fsdp2), or start one process without torchrun")
        return None
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device.startswith("cuda")
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        if local >= torch.cuda.device_count():
            raise ConfigError(f"LOCAL_RANK {local} but {torch.cuda.device_count()} CUDA device(s) here: start at "
                              "most one rank per GPU (torchrun --nproc-per-node)")
        torch.cuda.set_device(dev)
    backend = par.backend if par.backend != "auto" else ("nccl" if cuda else "gloo")
    timeout = timedelta(seconds=par.timeout_s)
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            store, rank, size = next(dist.rendezvous("env://", timeout=timeout))
            # torchrun's agent keeps one TCP store for all restarts of the group (torch 2.13 shares its rendezvous
            # store); without a prefix per attempt a restarted group read the addresses its dead predecessors had
            # published there, and gloo failed to connect (to the killed rank's old port) instead of resuming.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            dist.init_process_group(backend, store=dist.PrefixStore(f"grpo-stream/attempt-{attempt}", store),
                                    rank=rank, world_size=size, timeout=timeout, device_id=dev if cuda else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    env = Env(dist.get_rank(), dist.get_world_size(), local, dev, par.strategy)
    log.info("rank %d of %d (%s, %s on %s)", env.rank, env.world, par.strategy, backend, dev)
    return env


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- the split and the normalisation rule -------------------------------------------------------------------
def token_balanced_split(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Indices of ``lengths`` per rank, longest first to the rank with the fewest tokens so far (ties: the lower
    rank); each rank's indices in ascending order. Any rank's total exceeds any other's by at most the longest
    single length: a rank only ever receives an item while it holds the fewest tokens."""
    parts: list[list[int]]
    loads, parts = [0] * world, [[] for _ in range(world)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        loads[r] += lengths[i]
        parts[r].append(i)
    return [sorted(p) for p in parts]


def share(agg: str, rows: int, counted_tokens: float, batch_rows: int, batch_counted_tokens: float) -> float:
    """A micro-batch's weight in its batch's loss (THE rule: the module docstring). The world-size factor for
    DDP's/FSDP2's averaging is applied by the caller (:func:`grad_factor`)."""
    if agg == "token_mean":
        return float(counted_tokens) / max(float(batch_counted_tokens), 1.0)
    return rows / max(batch_rows, 1)


def grad_factor(env: Env | None) -> float:
    """DDP and FSDP2 divide the summed gradients by the world size; each rank's loss is scaled up by as much."""
    return float(env.world) if env is not None else 1.0


@dataclass
class Shard:
    """One rank's part of a learner step: its micro-batches (the same count on every rank) and the whole batch's
    denominators."""

    micro: list[Batch]
    padding: list[bool]  # True: a stand-in with weight 0 that keeps the ranks' collectives matched
    rows: int  # rows of the whole batch (the per-sequence means' denominator), eq. 8 masked rows included
    tokens: int  # completion tokens of the whole batch after eq. 8 (the entropy metric's denominator)


def plan_shards(batch: Batch, world: int, max_tokens: int) -> list[Shard]:
    """Split ``batch`` over ``world`` ranks: rows with a counted token, token-balanced by prompt + completion length
    (the forward's cost), each rank's rows cut into ``max_tokens`` micro-batches, padded to the same count."""
    rows, tokens = batch.num_rows, batch.num_tokens
    live = [i for i, n in enumerate(batch.completion_lengths.tolist()) if n > 0]
    lengths = batch.seq_lengths.tolist()
    parts = token_balanced_split([lengths[i] for i in live], world)
    micro = [microbatches(batch.rows([live[j] for j in part]), max_tokens) if part else [] for part in parts]
    count = max(len(m) for m in micro)
    if count == 0:  # nothing counted anywhere: no rank runs a pass, no rank has a gradient
        return [Shard([], [], rows, tokens) for _ in range(world)]
    pad = batch.rows(live[:1])
    return [Shard(m + [pad] * (count - len(m)), [False] * len(m) + [True] * (count - len(m)), rows, tokens)
            for m in micro]


def scatter(shards: list[Shard] | None, env: Env) -> Shard:
    """Rank 0 sends each rank its shard (``shards`` is None on the others)."""
    out: list[Any] = [None]
    dist.scatter_object_list(out, shards if env.leader else None, src=0)
    return cast(Shard, out[0])


def sum_over_ranks(values: dict[str, float], env: Env | None) -> dict[str, float]:
    """Per-key sums over the ranks (keys missing on a rank count 0), known to every rank."""
    if env is None or env.world == 1:
        return values
    gathered: list[Any] = [None] * env.world
    dist.all_gather_object(gathered, values)
    keys = sorted({k for d in gathered for k in d})
    return {k: sum(d.get(k, 0.0) for d in gathered) for k in keys}


# ---- the model ------------------------------------------------------------------------------------------------
class PolicyForward(nn.Module):
    """The policy's logprob pass as a module's forward, so DDP and FSDP2 see (and hook) every forward that the
    logprob code runs through ``base_model`` and the output head instead of the model's own forward."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.policy = model

    def forward(self, mb: Batch, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        if with_entropy:
            return completion_logprobs_with_entropy(self.policy, mb)
        return completion_logprobs(self.policy, mb), None


def wrap(model: nn.Module, par: ParallelConfig, env: Env | None) -> nn.Module:
    """``model`` behind :class:`PolicyForward`, under DDP or FSDP2 (which shards ``model`` in place)."""
    module = PolicyForward(model)
    if env is None:
        return module
    if env.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [env.device.index] if env.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(env.device.type, (env.world,))
    kwargs: dict[str, Any] = {"mesh": mesh, "offload_policy": CPUOffloadPolicy() if par.cpu_offload
                              else OffloadPolicy()}
    if par.mixed_precision != "none":
        # Inputs stay as they are: the batch's float tensors (temperatures, masks) must not be rounded to bf16.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=_DTYPES[par.mixed_precision],
                                                   reduce_dtype=_DTYPES[par.reduce_dtype], cast_forward_inputs=False)
    units = set(getattr(model, "_no_split_modules", None) or ())
    for sub in model.modules():
        if type(sub).__name__ in units:  # the decoder layers: one all-gather each
            fully_shard(sub, **kwargs)
    # The root unit holds the rest (embeddings, final norm and the output head, tied weights in one group).
    fully_shard(module, **kwargs)
    return module


def grad_sync(policy: nn.Module, last: bool) -> contextlib.AbstractContextManager[None]:
    """Reduce gradients only in the last backward of a step (the earlier ones accumulate locally)."""
    if hasattr(policy, "no_sync"):  # DDP
        return contextlib.nullcontext() if last else cast("DistributedDataParallel", policy).no_sync()
    if hasattr(policy, "set_requires_gradient_sync"):  # FSDP2
        cast("FSDPModule", policy).set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def tied_aliases(model: nn.Module) -> set[str]:
    """State-dict names of parameters that are another name's tensor (``lm_head.weight`` = the embedding): a
    gathered full state dict holds them as copies, the published file must not (``publish.unique_tensors``)."""
    seen: set[int] = set()
    aliases = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.add(name)
        seen.add(id(p))
    return aliases


def full_state_dict(model: nn.Module, env: Env | None, *, leader_only: bool) -> dict[str, Tensor]:
    """The unsharded weights of ``model`` (collective under FSDP2: every rank calls it). ``leader_only``: only rank
    0 gets them, on the CPU (the publish); otherwise every rank gets them on its device (the reference reset)."""
    if env is None or env.strategy != "fsdp2":
        return model.state_dict() if (env is None or env.leader or not leader_only) else {}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return cast(dict[str, Tensor],  # full_state_dict: plain tensors
                get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=leader_only)))


def total_norm(norm: Tensor) -> float:
    """A gradient norm as a float (FSDP2's clip returns a replicated DTensor)."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)
