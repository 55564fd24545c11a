"""Continuous, interruptible generation on vLLM's ``AsyncLLM``: groups in, groups out as each one finishes.

The producer's continuous loop (``producers/continuous.py``) keeps ``max_inflight_groups`` prompt groups in the
engine. :class:`AsyncVLLMEngine` runs the engine on an asyncio loop of its own (one thread) so the loop's
Kafka work never waits on generation and generation never waits on Kafka: :meth:`~AsyncVLLMEngine.submit`
starts a group of ``n`` requests and returns; finished groups arrive on :meth:`~AsyncVLLMEngine.finished` in
the order they finish, not the order they were submitted.

**In-flight weight updates** (:meth:`~AsyncVLLMEngine.swap`): the engine core's pause (``mode="keep"``) freezes
every request, the worker reloads the weights in place (the tied-head fix of ``vllm``), the resume continues them.
What a request in flight keeps across the swap is ``kv`` (the producer's ``weights.inflight_kv``):

* ``keep`` (the default; PipelineRL's choice): its KV cache, computed with the older weights, stays. Later tokens
  are sampled by the new weights attending over that prefix, a mix that is neither policy exactly; each token's
  recorded behaviour logprob is what the engine sampled it with, so the learner's ratio pi_theta / mu is exact
  against the distribution that really produced it. Nothing is recomputed: on the 2-core CPU the swap cost
  ~11% of continuous tokens/s against ~18% with ``recompute`` (``bench engine``).
* ``recompute``: vLLM's ``clear_cache``: running requests are preempted and on resume their prefix -- prompt and
  tokens sampled so far -- is *recomputed with the new weights*, so every later token is the new policy's given
  that prefix, at the price of a prefill of every request in flight at every swap.

Either way a request started after a swap never reuses prefix-cache blocks computed with older weights: every
request carries a ``cache_salt`` naming the weights in the engine when it was sent (vLLM keys cached blocks by
it), bumped at each swap and reload. Each token's behaviour logprob is the one returned when it was sampled; each
sample's ``spans`` records ``(version, first token)`` for every version behind its tokens.

The boundaries are vLLM's own: the swap labels the engine with the new version while it is paused
(``update_weight_version``), every step's outputs carry the label of the weights that computed them, and a finished
request reports ``(label, start, end)`` per version behind its tokens (``CompletionOutput.weight_versions``).
Exact by construction, with no wait for outputs still in transit; the vLLM test checks the boundary against an
HF recompute with each version's weights. A label the engine never got (no swap yet) is the group's submitted
version.

Also a :class:`~grpo_producers.backends.base.Backend` (``generate`` / ``load_weights``), so the batch loop runs
on it too: one interface for both loops.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import queue
import threading
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from grpo_producers.backends.base import (
    BackendConfig,
    KvOnSwap,
    Sample,
    SamplingConfig,
    check_request,
)
from grpo_producers.backends.lengths import LengthDraws
from grpo_producers.backends.vllm import (
    Decode,
    decoder,
    drawn_params,
    engine_kwargs,
    require_weights,
    sampling_params,
    text_decoder,
    to_sample,
)

T = TypeVar("T")
_UNLABELLED = "default"  # vLLM's weight-version label until update_weight_version sets one
_SHUTDOWN_TIMEOUT_S = 10.0


def _sample(c: Any, version: int, decode: Decode | None) -> Sample:
    """One finished sample (``to_sample``) with vLLM's weight-version spans (a label never set: ``version``)."""
    spans = tuple((version if w.version == _UNLABELLED else int(w.version), w.start)
                  for w in c.weight_versions or () if w.end > w.start) or ((version, 0),)
    return dataclasses.replace(to_sample(c, decode), spans=spans)


@dataclass(frozen=True)
class SwapTimes:
    """Where an in-flight swap's time went: waiting for the step under way to end (and, with ``recompute``,
    the KV cache to be cleared), labelling and reloading the weights, resuming the scheduler."""

    pause_s: float = 0.0
    reload_s: float = 0.0
    resume_s: float = 0.0


@dataclass
class Finished:
    """A group that left the engine: its samples in index order, or why it failed."""

    key: str
    samples: list[Sample] | None
    error: BaseException | None = None


class AsyncVLLMEngine:
    """vLLM's ``AsyncLLM`` behind a thread-safe, non-blocking group interface (see the module docstring)."""

    name = "vllm"

    def __init__(self, cfg: BackendConfig) -> None:
        self.cfg = cfg
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-async", daemon=True)
        self._thread.start()
        self._groups: dict[str, concurrent.futures.Future[list[Sample]]] = {}
        self._done: queue.Queue[Finished] = queue.Queue()
        self._lock = threading.Lock()
        self.last_swap = SwapTimes()
        self._weights = 0  # bumped whenever the weights change: the prefix cache's salt (module docstring)
        self.engine = self._call(self._start(cfg))
        model_config = self.engine.model_config
        self._max_context = int(model_config.max_model_len)
        self.vocab_size = int(model_config.get_vocab_size())
        self._decode = decoder(self.engine.get_tokenizer())
        self._lengths = LengthDraws(cfg.seed)

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @staticmethod
    async def _start(cfg: BackendConfig) -> Any:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(cfg)))

    def max_context(self) -> int:
        return self._max_context

    def capacity(self) -> int:
        """Sequences the engine runs at once (``max_num_seqs``): what ``max_inflight_groups: 0`` sizes from."""
        return int(self.engine.vllm_config.scheduler_config.max_num_seqs)

    # ---- the continuous interface ------------------------------------------------------------------
    def submit(self, key: str, prompt: list[int], n: int, sampling: SamplingConfig, version: int,
               seed: int | None = None) -> None:
        """Start ``n`` samples of ``prompt`` under ``version``; the group arrives on :meth:`finished`.
        ``seed``: this group's base seed (sample j gets ``seed + j``); None: the engine's stream."""
        check_request([prompt], n, sampling, self._max_context, self.vocab_size)
        fut = asyncio.run_coroutine_threadsafe(self._any_group(key, prompt, n, sampling, version, seed), self._loop)
        with self._lock:
            self._groups[key] = fut
        fut.add_done_callback(lambda f: self._finish(key, f))

    def _finish(self, key: str, fut: concurrent.futures.Future[list[Sample]]) -> None:
        with self._lock:
            if self._groups.get(key) is not fut:
                return
            del self._groups[key]
        if fut.cancelled():
            return  # aborted by the caller, who already forgot it
        error = fut.exception()
        self._done.put(Finished(key, None if error else fut.result(), error))

    def finished(self, timeout: float) -> list[Finished]:
        """Groups finished since the last call (waits up to ``timeout`` s for the first one)."""
        out: list[Finished] = []
        try:
            out.append(self._done.get(timeout=timeout))
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            return out

    def abort(self, key: str) -> bool:
        """Stop a group's requests in the engine; it never arrives on :meth:`finished`. False if unknown."""
        with self._lock:
            fut = self._groups.pop(key, None)
        if fut is None:
            return False
        fut.cancel()
        return True

    def inflight(self) -> int:
        with self._lock:
            return len(self._groups)

    def swap(self, model_dir: Path, version: int, kv: KvOnSwap = "keep") -> None:
        """Reload the weights with every request kept in flight; later tokens are ``version``'s. ``kv``: what
        those requests keep (see the module docstring)."""
        require_weights(model_dir)
        self._call(self._swap(str(model_dir), version, clear_cache=kv == "recompute"))

    async def _swap(self, path: str, version: int, clear_cache: bool) -> None:
        t0 = time.perf_counter()
        # The engine core's pause itself, not AsyncLLM.pause_generation: that adds a fixed 20 ms sleep so that
        # outputs already in transit reach their callers first -- ordering for a human caller, paid on every
        # swap (the pause took 40-48 ms with it, 25 ms without, on the tiny model on CPU), and unneeded here:
        # the spans come from vLLM's version labels, not from when outputs arrive.
        await self.engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=clear_cache)
        t1 = time.perf_counter()
        # Every request sent from here on reaches the engine after the pause, so it runs only on the new
        # weights: a new salt keeps it off blocks cached with the old ones. One sent before keeps the old salt.
        self._weights += 1
        try:
            # Labelled while paused, so every output of a step after this one carries the new version.
            await self.engine.update_weight_version(str(version))
            await self.engine.collective_rpc("grpo_reload_weights", args=(path,))
        finally:
            t2 = time.perf_counter()
            await self.engine.resume_generation()
            self.last_swap = SwapTimes(t1 - t0, t2 - t1, time.perf_counter() - t2)

    async def _any_group(self, key: str, prompt: list[int], n: int, sampling: SamplingConfig, version: int,
                         seed: int | None) -> list[Sample]:
        """A group of ``n`` samples: one request of n, or with drawn lengths (``sampling.lengths``) one request
        per sample, each exactly its length, delivered together when the last is done."""
        if not sampling.lengths.controlled:
            return await self._group(key, prompt, n, sampling, version, seed)
        drawn = self._lengths(sampling.lengths, n, int(sampling.max_tokens or 1))
        parts = [self._request(f"{key}/{j}", prompt, 1, p, version, self._decode)
                 for j, p in enumerate(drawn_params(sampling, drawn, seed, output_kind=_final_only()))]
        return [s for part in await asyncio.gather(*parts) for s in part]

    async def _group(self, key: str, prompt: list[int], n: int, sampling: SamplingConfig, version: int,
                     seed: int | None) -> list[Sample]:
        """One request of ``n`` samples (vLLM's parallel sampling: the prompt is processed once, sample j's
        seed is ``seed + j``), delivered once, when all of them are done."""
        return await self._request(key, prompt, n, _params(sampling, n, seed), version,
                                   text_decoder(sampling, self._decode))

    async def _request(self, key: str, prompt: list[int], n: int, params: Any, version: int,
                       decode: Decode | None) -> list[Sample]:
        """One engine request of ``n`` samples under ``params``, its samples in index order once all are done."""
        from vllm import TokensPrompt

        rid = f"{key}/{uuid.uuid4().hex[:8]}"
        final = None
        try:
            request = TokensPrompt(prompt_token_ids=list(prompt), cache_salt=f"grpo-weights-{self._weights}")
            async for out in self.engine.generate(request, params, rid):
                final = out
        except BaseException:
            await self.engine.abort(rid)
            raise
        if final is None or not final.finished or len(final.outputs) != n:
            raise RuntimeError(f"vLLM ended request {rid} without its {n} samples")
        return [_sample(c, version, decode) for c in sorted(final.outputs, key=lambda c: c.index)]

    # ---- the batch interface (Backend) -------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> list[list[Sample]]:
        check_request(prompts, n, sampling, self._max_context, self.vocab_size)

        async def batch() -> list[list[Sample]]:
            seeds = [None if sampling.seed is None else sampling.seed + i * n for i in range(len(prompts))]
            return list(await asyncio.gather(*(self._any_group(f"batch-{uuid.uuid4().hex[:8]}", p, n, sampling, 0, s)
                                               for p, s in zip(prompts, seeds, strict=True))))

        # Weights never change under a batch: one version, the caller's (no spans).
        return [[dataclasses.replace(s, spans=()) for s in group] for group in self._call(batch())]

    def load_weights(self, model_dir: Path) -> None:
        """Reload with nothing in flight (the batch loop swaps between batches); KV computed before is dropped.
        The engine's version label is cleared: a later group's tokens are its submitted version's."""
        require_weights(model_dir)
        self._call(self._reload(str(model_dir)))

    async def _reload(self, path: str) -> None:
        await self.engine.collective_rpc("grpo_reload_weights", args=(path,))
        self._weights += 1
        await self.engine.reset_prefix_cache()
        await self.engine.update_weight_version(_UNLABELLED)

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        del self.engine
        for key in list(self._groups):
            self.abort(key)
        # AsyncLLM.shutdown stops the engine core before it cancels its output handler, which is then waiting
        # on the core: it fails with EngineDeadError and logs an ERROR traceback at every clean stop. Cancelled
        # first, it ends quietly. A loop too wedged to cancel it within the timeout must not keep the engine's
        # processes alive: shut down regardless.
        try:
            self._call(_cancel(getattr(engine, "output_handler", None)), _SHUTDOWN_TIMEOUT_S)
        finally:
            engine.shutdown(timeout=_SHUTDOWN_TIMEOUT_S)
        # The shutdown asks the loop to cancel the client's socket tasks; stopped before they have ended, the loop
        # leaves them pending and their garbage collection logs asyncio's "Task was destroyed but it is pending!"
        # ERROR. Let them end first.
        with contextlib.suppress(concurrent.futures.TimeoutError):
            self._call(_settle(), _SHUTDOWN_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(_SHUTDOWN_TIMEOUT_S)


async def _cancel(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has ended (None: nothing to do)."""
    if task is None or task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _settle() -> None:
    """Cancel every other task on the running loop and wait until each has ended."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _final_only() -> Any:
    """Each request's output delivered once, when it is done. Streaming every step's tokens (DELTA) costs Python
    work per request per step in this process, on the core generation runs on: fewer tokens/s, and nothing needs
    them (the version spans come with the final output)."""
    from vllm.sampling_params import RequestOutputKind

    return RequestOutputKind.FINAL_ONLY


def _params(sampling: SamplingConfig, n: int, seed: int | None) -> Any:
    """``n`` samples in one request, delivered once, when all are done."""
    return sampling_params(sampling, n, seed, output_kind=_final_only())
