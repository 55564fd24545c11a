"""grpo-stream learner."""
