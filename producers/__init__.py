"""grpo-stream the producer side: feeder, generation loop and backends, backpressure. Imported as
``grpo_producers`` (stands on grpo_core alone; never imports another service)."""
