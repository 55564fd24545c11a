"""Generation backends for the producer (``hf``, ``vllm``) behind :class:`Backend`; see ``base``."""

from grpo_producers.backends.base import (
                                     BACKENDS,
                                     Backend,
                                     BackendConfig,
                                     BackendKind,
                                     FinishReason,
                                     Sample,
                                     SamplingConfig,
                                     make_backend,
)

__all__ = ["BACKENDS", "Backend", "BackendConfig", "BackendKind", "FinishReason", "Sample", "SamplingConfig",
           "make_backend"]
