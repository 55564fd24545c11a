"""The core of grpo-stream: what every role stands on, and nothing that stands on a role.

* :mod:`grpo_core.contract` -- the pipeline contract (group size, names, std epsilon, staleness bound...).
* :mod:`grpo_core.config` -- typed configs from YAML + ``key=value`` overrides, validated at start-up.
* :mod:`grpo_core.wire` -- the records on every topic, and their validation.
* :mod:`grpo_core.kafka_io` -- the Kafka seam: clients, the offset-commit rule, dead letters, lag.
* :mod:`grpo_core.topics` -- creating the topic plan; :mod:`grpo_core.retry` -- the one retry loop.
* :mod:`grpo_core.stats` -- group statistics (eq. 2); :mod:`grpo_core.staleness` -- the staleness rule.
* :mod:`grpo_core.weights` -- publishing and fetching policy weights (fs and kafka stores).
* :mod:`grpo_core.metrics`, :mod:`grpo_core.process`, :mod:`grpo_core.fsutil` -- per-process plumbing.
"""
