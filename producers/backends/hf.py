"""The Hugging Face backend: ``model.generate`` on a batch of left-padded prompts.

Starts in about a second and needs nothing beyond ``transformers``: the backend for tests, the CPU demo and short
runs (vLLM costs ~20 s to start on CPU). Behaviour logprobs come from ``output_logits=True`` -- the raw logits of
every step, before temperature/top-k/top-p -- through the same float32 ``log_softmax`` as the learner
(``learner/logprobs.py``), so they agree with its recomputation to float32 rounding.

Sampling reproducibility: HF samples with the process-global torch RNG. The backend swaps in its own RNG state
around each call (seeded from ``BackendConfig.seed``, or from ``SamplingConfig.seed`` for one call), so its
stream is reproducible and neither disturbs nor depends on other torch users in the process (the learner in
tests, a second backend). Samples still depend on how prompts are batched (``max_batch_prompts``), as in any
batched sampler.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    StoppingCriteria,
    StoppingCriteriaList,
)

from grpo_producers.backends.base import (
    BackendConfig,
    Sample,
    SamplingConfig,
    check_request,
    stop_cut,
    stop_lookback_tokens,
)
from grpo_producers.backends.lengths import LengthDraws

if TYPE_CHECKING:
    from transformers.generation.utils import GenerateDecoderOnlyOutput


class HFBackend:
    """:class:`~grpo_producers.backends.base.Backend` on ``transformers`` (one model, one device)."""

    name = "hf"

    def __init__(self, cfg: BackendConfig) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.model)
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=getattr(torch, cfg.dtype))
        # PreTrainedModel.to is @wraps(nn.Module.to) with no annotations: mypy passes the device as `self`.
        self.model: PreTrainedModel = model.to(self.device).eval()  # type: ignore[arg-type]
        self.eos_ids = _eos_ids(model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id: int = self.eos_ids[0] if pad is None else int(pad)
        # A checkpoint's generation_config.json (e.g. Qwen's top_k=20, repetition_penalty=1.05) would silently
        # change the sampling distribution; SamplingConfig alone decides it, as in vLLM.
        self.model.generation_config = GenerationConfig(eos_token_id=self.eos_ids, pad_token_id=self.pad_id)
        text_config = self.model.config.get_text_config()
        self.vocab_size = int(text_config.vocab_size)
        self._max_context = int(text_config.max_position_embeddings)
        self._rng_state: list[torch.Tensor] | None = None
        self._lengths = LengthDraws(cfg.seed)

    def max_context(self) -> int:
        return self._max_context

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> list[list[Sample]]:
        check_request(prompts, n, sampling, self._max_context, self.vocab_size)
        out: list[list[Sample]] = []
        step = self.cfg.max_batch_prompts
        with self._own_rng(sampling.seed), torch.inference_mode():
            for start in range(0, len(prompts), step):
                out += self._generate_chunk(prompts[start:start + step], n, sampling)
        return out

    def _generate_chunk(self, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> list[list[Sample]]:
        input_ids, attention_mask = left_pad(prompts, self.pad_id, self.device)
        width = input_ids.shape[1]
        greedy = sampling.temperature == 0
        reps = 1 if greedy else n  # HF refuses num_return_sequences > 1 for greedy; the copies are identical
        criteria = StoppingCriteriaList()
        if sampling.stop:
            criteria.append(StopStrings(self.tokenizer, sampling.stop, width))
        config = self._generation_config(sampling, reps)
        drawn = None
        if sampling.lengths.controlled:  # each row exactly its drawn length: EOS does not end it
            drawn = self._lengths(sampling.lengths, len(prompts) * reps, int(sampling.max_tokens or 1))
            config.eos_token_id, config.max_new_tokens = None, max(drawn)
            criteria.append(DrawnLengths(width, drawn))
        # return_dict_in_generate (the config): a GenerateDecoderOnlyOutput. The model class mixes in generate().
        gen: GenerateDecoderOnlyOutput = cast(Any, self.model).generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=config, stopping_criteria=criteria)
        new = gen.sequences[:, width:]
        assert gen.logits is not None  # output_logits=True (_generation_config)
        tempered = self.cfg.logprobs == "sampling" and not greedy
        logprobs = sampled_logprobs(gen.logits, new, sampling.temperature if tempered else 1.0)
        tokens_np, logprobs_np = new.cpu().numpy(), logprobs.cpu().numpy()
        if drawn is not None:
            samples = [self._cut(tokens_np[r], logprobs_np[r], drawn[r]) for r in range(new.shape[0])]
        else:
            samples = [self._sample(tokens_np[r], logprobs_np[r], sampling.stop) for r in range(new.shape[0])]
        if greedy:
            return [[_copy(samples[i]) for _ in range(n)] for i in range(len(prompts))]
        return [samples[i * n:(i + 1) * n] for i in range(len(prompts))]  # generate() repeats each prompt n times

    def _generation_config(self, sampling: SamplingConfig, reps: int) -> GenerationConfig:
        common = {"max_new_tokens": sampling.max_tokens, "num_return_sequences": reps, "output_logits": True,
                  "return_dict_in_generate": True, "eos_token_id": self.eos_ids, "pad_token_id": self.pad_id}
        if sampling.temperature == 0:
            return GenerationConfig(do_sample=False, **common)
        # top_k must be explicit: generate()'s global default is 50; 0 is "off" as in vLLM.
        return GenerationConfig(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                                top_k=sampling.top_k, **common)

    def _sample(self, tokens: np.ndarray, logprobs: np.ndarray, stop: Sequence[str]) -> Sample:
        keep, reason, text = stop_cut(tokens.tolist(), self.eos_ids, stop, self._decode)
        return Sample(tokens[:keep].astype(np.int32), logprobs[:keep].astype(np.float32), reason, text)

    def _cut(self, tokens: np.ndarray, logprobs: np.ndarray, length: int) -> Sample:
        """A sample of a drawn length: its first ``length`` tokens, whatever they are (EOS included)."""
        kept = tokens[:length].astype(np.int32)
        return Sample(kept, logprobs[:length].astype(np.float32), "length", self._decode(kept.tolist()))

    def _decode(self, ids: Sequence[int]) -> str:
        return cast(str, self.tokenizer.decode(list(ids), skip_special_tokens=True))  # one sequence: one text

    @contextmanager
    def _own_rng(self, seed: int | None) -> Iterator[None]:
        """Sample with the backend's RNG stream (or ``seed`` for one call); the global state is restored after."""
        cuda = self.device.type == "cuda"
        devices = [self.device.index if self.device.index is not None else torch.cuda.current_device()] if cuda else []
        with torch.random.fork_rng(devices=devices):
            if seed is not None or self._rng_state is None:
                self._seed(self.cfg.seed if seed is None else seed)
            else:
                self._set_rng(self._rng_state)
            yield
            if seed is None:
                self._rng_state = self._get_rng()

    def _seed(self, seed: int) -> None:
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(seed)

    def _get_rng(self) -> list[torch.Tensor]:
        states = [torch.get_rng_state()]
        if self.device.type == "cuda":
            states.append(torch.cuda.get_rng_state(self.device))
        return states

    def _set_rng(self, states: list[torch.Tensor]) -> None:
        torch.set_rng_state(states[0])
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(states[1], self.device)

    def load_weights(self, model_dir: Path) -> None:
        """Copy the ``*.safetensors`` weights of ``model_dir`` into the loaded model, in place.

        A tied ``lm_head.weight`` is absent from the file (it is the embedding); any other missing or unknown
        tensor is an error -- a partial load would silently mix two policies. Shapes must match (torch checks).
        """
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors file to load weights from")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        loaded = [params[k] for k in state if k in params]
        untied = [k for k in missing if not any(params.get(k) is p for p in loaded)]
        if untied or unexpected:
            raise ValueError(f"{model_dir}: weights do not match the model: missing {untied}, unexpected "
                             f"{unexpected} (was the model half updated? reload the backend)")

    def close(self) -> None:
        if not hasattr(self, "model"):
            return  # already closed
        del self.model
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class StopStrings(StoppingCriteria):
    """Ends a sequence as soon as its completion text contains a stop string (an early exit only).

    Unlike ``generate(stop_strings=...)`` it looks at the completion alone, never at a stop string straddling
    the prompt, so it agrees with :func:`~grpo_producers.backends.base.stop_cut`, which decides where a sample ends.
    Only the last few tokens are decoded per step (:func:`stop_lookback_tokens`): O(tokens), not O(tokens^2).
    """

    def __init__(self, tokenizer: object, stop: Sequence[str], prompt_width: int) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.start = prompt_width
        self.window = stop_lookback_tokens(stop)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor | None,
                 **kwargs: object) -> torch.BoolTensor:
        tails = input_ids[:, max(self.start, input_ids.shape[1] - self.window):].tolist()
        texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True)  # type: ignore[attr-defined]
        hit = [any(s in t for s in self.stop) for t in texts]
        return torch.tensor(hit, dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]


class DrawnLengths(StoppingCriteria):
    """Ends each row once it has its drawn number of new tokens (``sampling.lengths``); ``generate`` pads a
    finished row while the others go on, and the backend cuts every row to its length."""

    def __init__(self, prompt_width: int, lengths: Sequence[int]) -> None:
        self.start = prompt_width
        self.lengths = torch.tensor(list(lengths), dtype=torch.long)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor | None,
                 **kwargs: object) -> torch.BoolTensor:
        done = self.lengths.to(input_ids.device) <= input_ids.shape[1] - self.start
        return done  # type: ignore[return-value]


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` [B, longest] with prompts aligned to the right edge.

    Left padding puts every prompt's last token in the same column, so each step appends to all rows at once;
    ``generate`` derives position ids from the mask, so positions still count from each prompt's first token,
    as in the learner's right-padded recomputation.
    """
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def sampled_logprobs(step_logits: Sequence[torch.Tensor], tokens: torch.Tensor,
                     temperature: float = 1.0) -> torch.Tensor:
    """[rows, T] float32: log-softmax of step t's logits / ``temperature`` at ``tokens[:, t]`` (``output_logits``
    are the raw logits, before the temperature and truncation generate() applies to sample).

    One step at a time, so only one [rows, vocab] float32 copy exists besides the logits HF already holds.
    """
    if not step_logits:
        return torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    cols = [(logits.float() / temperature).log_softmax(-1).gather(-1, tokens[:, t:t + 1]).squeeze(-1)
            for t, logits in enumerate(step_logits)]
    return torch.stack(cols, 1)


def _eos_ids(model: PreTrainedModel, tokenizer: object) -> list[int]:
    """Every token that ends a sample: the checkpoint's generation EOS ids (chat models list several, e.g.
    ``<|im_end|>`` and ``<|endoftext|>``) plus the tokenizer's EOS."""
    ids: list[int] = []
    configured = getattr(model.generation_config, "eos_token_id", None)
    if configured is not None:
        ids += [int(i) for i in (configured if isinstance(configured, list) else [configured])]
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None and int(tok_eos) not in ids:
        ids.append(int(tok_eos))
    if not ids:
        raise ValueError("the model has no EOS token (neither generation_config.eos_token_id nor the tokenizer's)")
    return ids


def _copy(sample: Sample) -> Sample:
    return Sample(sample.token_ids.copy(), sample.logprobs.copy(), sample.finish_reason, sample.text)
