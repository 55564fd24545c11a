"""grpo-stream producers."""
