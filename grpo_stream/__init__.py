"""grpo-stream, the application: the ``grpo-stream`` command (CLI, run supervisor, demo, benchmarks, report,
k8s generation, the local dev broker). It stands on the services (grpo_producers, grpo_verifiers, grpo_learner)
and the core (grpo_core); nothing imports it."""
