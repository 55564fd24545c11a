"""grpo-stream the verifier service: scoring, group assembly, the rewards library and its sandbox.
Imported as ``grpo_verifiers`` (stands on grpo_core alone; never imports another service)."""
