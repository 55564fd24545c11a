"""grpo-stream grpo_stream."""
