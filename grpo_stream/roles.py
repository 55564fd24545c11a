"""The roles a ``grpo-stream`` command can start, and the typed config class of each (imported on demand: a
role's module pulls in torch or transformers, which ``config explain`` and ``k8s check`` should not pay for)."""

from __future__ import annotations

import importlib

# role -> (module with main(config, overrides, pipeline), its config class)
ROLE_MODULES: dict[str, tuple[str, str]] = {
    "learner": ("grpo_learner.service", "grpo_learner.config:LearnerConfig"),
    "producer": ("grpo_producers.service", "grpo_producers.config:ProducerConfig"),
    "verifier": ("grpo_verifiers.service", "grpo_verifiers.config:VerifierConfig"),
    "feed": ("grpo_producers.feeder", "grpo_producers.feeder_config:FeederConfig"),
    "feeder": ("grpo_producers.feeder", "grpo_producers.feeder_config:FeederConfig"),
    "pipeline": ("", "grpo_core.contract:PipelineContract"),
    "topics": ("", "grpo_core.topics:TopicsFileConfig"),
}


def config_class(role: str) -> type:
    return import_class(ROLE_MODULES[role][1])


def import_class(path: str) -> type:
    """The class a ``module:Name`` path names."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)
