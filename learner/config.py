"""The learner's typed config (``grpo-stream learner --config FILE [key=value ...]``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from grpo_core.config import KafkaConfig, MetricsConfig, check_model_path, opt, require
from grpo_core.contract import PipelineContract
from grpo_core.trackers import Tracker, check_installed
from grpo_core.weights.config import WeightStoreConfig
from grpo_learner.advantages_config import AdvantageConfig
from grpo_learner.loss_config import LossConfig


@dataclass
class ModelConfig:
    """The policy: any HF causal LM by hub id or local path (loaded with AutoModelForCausalLM)."""

    path: str = opt(help="HF model id (org/name) or local directory (config.json + *.safetensors); at start a "
                         "value that is neither an existing directory nor of the hub's form is refused.")
    dtype: Literal["float32", "bfloat16", "float16"] = opt("float32", "Training dtype (float32 on CPU).")
    device: str = opt("cpu", "cpu, cuda or cuda:N.")
    gradient_checkpointing: bool = opt(False, "Trade compute for activation memory on long sequences.")
    trust_remote_code: bool = opt(False, "Passed to from_pretrained.")

    def validate(self) -> None:
        require(bool(self.path), "model.path: required (a HF id like Qwen/Qwen2.5-0.5B-Instruct or a directory)")
        require(self.device == "cpu" or self.device.startswith("cuda"), f"model.device: {self.device!r}: cpu|cuda[:N]")


@dataclass
class OptimConfig:
    """AdamW with linear warm-up and gradient-norm clipping."""

    lr: float = opt(1e-6, "Learning rate (paper: 5e-6 GSM8K, 1e-6 DeepScaleR; verl's actor, TRL: 1e-6).")
    weight_decay: float = opt(0.0, "AdamW weight decay. TRL: 0.0; differs from verl's actor: 0.01.")
    beta1: float = opt(0.9, "AdamW beta1 (verl, TRL: 0.9).")
    beta2: float = opt(0.999, "AdamW beta2 (verl, TRL: 0.999).")
    adam_eps: float = opt(1e-8, "AdamW epsilon (verl, TRL: 1e-8).")
    max_grad_norm: float = opt(1.0, "Clip the global gradient norm to this (<= 0: no clipping; verl, TRL: 1.0).")
    warmup_steps: int = opt(
        0, "Linear learning-rate warm-up over this many optimizer steps, then a constant rate (as verl's default; "
           "differs from TRL, whose rate decays linearly to 0 over the run).")

    def validate(self) -> None:
        require(self.lr > 0, f"optim.lr: must be > 0, got {self.lr}")
        require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1/beta2: must be in [0, 1)")
        require(self.warmup_steps >= 0, "optim.warmup_steps: must be >= 0")


Strategy = Literal["none", "ddp", "fsdp2"]


@dataclass
class ParallelConfig:
    """Data parallelism: one learner on N ranks under ``torchrun`` (learner/parallel.py). Rank 0 alone talks to
    Kafka; every rank trains a token-balanced share of each batch; gradients are averaged by DDP or FSDP2."""

    strategy: Strategy = opt(
        "none", "none: one process, the classic learner (checkpoints: model/ + trainer.pt). ddp: every rank holds "
                "the whole model, DDP all-reduces gradients. fsdp2: torch's fully_shard shards parameters, gradients "
                "and optimizer state over the ranks. ddp and fsdp2 checkpoint with torch.distributed.checkpoint; "
                "started without torchrun they run as a world of one rank.")
    mixed_precision: Literal["none", "bfloat16", "float16"] = opt(
        "none", "fsdp2 only: the dtype parameters are all-gathered and computed in (FSDP2 MixedPrecisionPolicy "
                "param_dtype); the sharded master weights and the optimizer stay in model.dtype (float32).")
    reduce_dtype: Literal["float32", "bfloat16"] = opt(
        "float32", "fsdp2 with mixed_precision: the dtype gradients are reduce-scattered in.")
    cpu_offload: bool = opt(
        False, "fsdp2 on CUDA only: keep the sharded parameters, gradients and optimizer state in (pinned) host "
               "memory and step the optimizer on the CPU (FSDP2 CPUOffloadPolicy).")
    backend: Literal["auto", "gloo", "nccl"] = opt(
        "auto", "torch.distributed backend. auto: nccl when model.device is cuda, gloo on cpu.")
    timeout_s: float = opt(
        1800.0, "How long a rank waits in a collective (the followers wait for rank 0's next command, rank 0 keeps "
                "them alive while it waits for Kafka). Must exceed the longest checkpoint or weight publish.")

    def validate(self) -> None:
        require(self.strategy in ("none", "ddp", "fsdp2"),
                f"parallel.strategy: {self.strategy!r} is not one of ['none', 'ddp', 'fsdp2']")
        require(self.mixed_precision == "none" or self.strategy == "fsdp2",
                f"parallel.mixed_precision: {self.mixed_precision} needs strategy fsdp2 (got {self.strategy}); "
                "with ddp or none set model.dtype instead")
        require(not self.cpu_offload or self.strategy == "fsdp2",
                f"parallel.cpu_offload: needs strategy fsdp2 (got {self.strategy})")
        require(self.timeout_s >= 60, f"parallel.timeout_s: must be >= 60 s, got {self.timeout_s}")


@dataclass
class LearnerConfig:
    """One learner process: consume scored groups, train, publish weights, checkpoint."""

    pipeline: PipelineContract = opt(factory=PipelineContract, help="What every role agrees on (grpo_core.contract).")
    out_dir: str = opt("", "Where checkpoints/ and lineage.jsonl go. Empty: runs/<pipeline.run>.")
    kafka: KafkaConfig = opt(factory=KafkaConfig, help="Cluster connection.")
    metrics: MetricsConfig = opt(factory=MetricsConfig, help="/metrics and /health endpoint.")
    model: ModelConfig = opt(factory=lambda: ModelConfig(path=""), help="The policy model.")
    loss: LossConfig = opt(factory=LossConfig, help="The surrogate objective (learner/loss.py).")
    advantages: AdvantageConfig = opt(factory=AdvantageConfig, help="Rewards -> advantages (eq. 2, 8).")
    optim: OptimConfig = opt(factory=OptimConfig, help="Optimizer.")
    weights: WeightStoreConfig = opt(factory=WeightStoreConfig, help="Where published weights go.")
    parallel: ParallelConfig = opt(factory=ParallelConfig, help="Data-parallel training under torchrun.")
    skip_to: dict[str, int] = opt(
        factory=dict, help="Operator skip at start-up: {partition: offset} to resume the groups topic from, past "
                           "records the learner must not train. Recorded in the lineage (operator_skip) and "
                           "checkpointed; targets behind the checkpoint do nothing. A reset of the consumer group "
                           "does not move the learner: the checkpoint wins.")
    start_from: Literal["earliest", "latest"] = opt(
        "earliest", "Where a run without a checkpoint starts reading the groups topic.")
    accept_partial: bool = opt(True, "Train groups a verifier published as partial (fewer than G members).")
    min_valid_rewards: int = opt(
        2, "A group whose verifier could not score some members (failed rewards: never trained) is trained on the "
           "rest only if at least this many are left; otherwise dropped with reason reward_failed.")
    groups_per_batch: int = opt(8, "B: scored groups per learner step.")
    flush_after_s: float = opt(
        0.0, "Train a short batch of the groups queued once no group arrived for this long, so the tail of a "
             "finite feed is trained too (0: always wait for groups_per_batch).")
    grad_steps_per_batch: int = opt(1, "i (paper): optimizer steps taken on each batch.")
    publish_every: int = opt(1, "v (paper): publish weights every v learner steps.")
    micro_batch_tokens: int = opt(16384, "Token budget (rows x padded length) of one forward/backward.")
    max_seq_len: int = opt(0, "Longest prompt+completion accepted (0: the model's max_position_embeddings).")
    max_steps: int = opt(0, "Stop after this many learner steps (0: run until stopped).")
    stage_steps: int = opt(0, "Reset pi_ref to the current policy every N steps (Alg. 1 stages; 0: fixed ref).")
    checkpoint_every: int = opt(10, "Checkpoint every N steps (alone decides checkpoints unless "
                                    "checkpoint_on_publish).")
    checkpoint_async: bool = opt(
        True, "Write checkpoints from a background thread: the step loop only copies the state (model, optimizer, "
              "offsets, dedup position, all of one step) into reused buffers and trains on. One checkpoint in "
              "flight; the next waits for it. Sharded (ddp/fsdp2) checkpoints are written synchronously.")
    checkpoint_on_publish: bool = opt(
        False, "Also checkpoint every publish step, and announce a version only once its checkpoint is committed: "
               "every announced version can then be restored after a crash, at the cost of a checkpoint per "
               "publish. Off: versions announced after the last checkpoint are re-trained after a crash and "
               "announced again under a new incarnation (grpo_learner.saving).")
    publish_async: bool = opt(
        True, "Publish from a background thread: the step loop copies the weights into a reused buffer (a "
              "device-to-host copy on a GPU) and trains on while the copy is serialised, hashed, written and "
              "announced.")
    publish_overlap: Literal["wait", "skip"] = opt(
        "wait", "A publish step that comes while the previous version is still being written: wait for it "
                "(counted in grpo_stream_learner_save_wait_seconds_total), or skip this version (the next publish "
                "step publishes a newer one; counted in grpo_stream_learner_publishes_skipped_total).")
    publish_dtype: Literal["auto", "float32", "bfloat16", "float16"] = opt(
        "auto", "The dtype of published weights (what the producers load), cast from the master weights at the "
                "snapshot; auto: the model's own dtype.")
    keep_checkpoints: int = opt(2, "Checkpoints kept on disk.")
    publish_initial: bool = opt(True, "Publish the starting weights as version 0 when a run begins.")
    dedup_window: int = opt(1_000_000, "How many trained group ids are remembered to ignore duplicates "
                                         "(in checkpoints/seen-N.jsonl; each checkpoint appends its new ones).")
    poll_timeout_ms: int = opt(500, "Kafka poll timeout.")
    idle_timeout_s: float = opt(0.0, "Exit if no group arrives for this long (0: wait forever).")
    seed: int = opt(0, "Seed for torch/numpy/python RNGs.")
    report_to: list[Tracker] = opt(
        factory=list, help="Experiment trackers fed the per-step metrics (as in metrics.jsonl) with this config "
        "as hyperparameters: tensorboard (<out_dir>/tensorboard/learner/), wandb (WANDB_MODE=offline keeps it "
        "local). See grpo_core.trackers.")

    def validate(self) -> None:
        require(self.groups_per_batch >= 1, "groups_per_batch: must be >= 1")
        check_installed(self.report_to)
        require(1 <= self.min_valid_rewards <= self.pipeline.group_size,
                f"min_valid_rewards: must be in [1, pipeline.group_size={self.pipeline.group_size}]")
        require(self.flush_after_s >= 0, "flush_after_s: must be >= 0 (0: off)")
        require(all(p.isdigit() and o >= 0 for p, o in self.skip_to.items()),
                f"skip_to: expected {{partition: offset}} with non-negative numbers, got {self.skip_to}")
        require(self.grad_steps_per_batch >= 1, "grad_steps_per_batch: must be >= 1 (the paper's i)")
        require(self.publish_every >= 1, "publish_every: must be >= 1 (the paper's v)")
        require(self.micro_batch_tokens >= 64, "micro_batch_tokens: must be >= 64")
        require(self.checkpoint_every >= 1, "checkpoint_every: must be >= 1")
        require(self.max_steps >= 0 and self.stage_steps >= 0, "max_steps/stage_steps: must be >= 0")
        require(self.dedup_window >= 1000, "dedup_window: must be >= 1000")
        par = self.parallel
        require(par.mixed_precision == "none" or self.model.dtype == "float32",
                f"parallel.mixed_precision={par.mixed_precision} keeps float32 master weights: set "
                f"model.dtype=float32 (got {self.model.dtype})")
        require(not par.cpu_offload or self.model.device.startswith("cuda"),
                "parallel.cpu_offload: offloads from a GPU to host memory; with model.device=cpu set it false")
        require(par.backend != "nccl" or self.model.device.startswith("cuda"),
                "parallel.backend=nccl: needs model.device=cuda (gloo or auto on cpu)")
        require(par.strategy == "none" or self.model.device in ("cpu", "cuda"),
                f"model.device={self.model.device!r}: with parallel.strategy={par.strategy} say cpu or cuda; each "
                "rank takes cuda:LOCAL_RANK")

    def check_paths(self) -> None:
        """What must exist on this machine before the learner starts (grpo_core.config.check_paths)."""
        check_model_path(self.model.path, "model.path")

    def loss_config(self) -> LossConfig:
        """The loss config with ``max_len_norm`` resolved: Dr.GRPO's constant is the longest completion."""
        return dataclasses.replace(self.loss, max_len_norm=self.loss.max_len_norm or self.pipeline.max_new_tokens)
