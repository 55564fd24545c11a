"""grpo-stream verifiers."""
