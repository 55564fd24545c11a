"""grpo-stream the learner service: loss, advantages, batching, training, checkpoints, lineage. Imported as
``grpo_learner`` (stands on grpo_core alone; never imports another service)."""
