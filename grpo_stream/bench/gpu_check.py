"""The GPU check (issue #12, section 4): what runs on one GPU without a broker, vLLM, Java or a network.

On a model of Qwen2.5-0.5B's shape (random weights, bf16): the learner's real train step under the paper's §5.1
learner config on 28 in-memory scored groups of G = 16 x 200 tokens, i = 1 and i = 10 (step time split, tokens/s,
peak memory, MFU); the HF backend generating (tokens/s); the on-policy ratio check (the learner's recompute of the
backend's samples against its logprobs); ``bench throughput``'s learner side, one step per model preset
(:mod:`grpo_stream.bench.gpu_presets`); what publishing at every step costs the step loop, with the
device-to-host snapshot and the background write (:mod:`grpo_stream.bench.gpu_saving`). Run by
``ops/gpu-check.sh`` (its header: what the machine needs); ``--smoke`` runs the same code on CPU with a tiny shape
in seconds (the test suite's mode).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import resource
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from grpo_core import wire
from grpo_core.config import build, read_yaml, validate_tree
from grpo_learner.batching import collate, microbatches
from grpo_learner.config import LearnerConfig
from grpo_learner.logprobs import completion_logprobs
from grpo_learner.trainer import DTYPES, StepStats, Trainer, load_model
from grpo_producers.backends.base import BackendConfig, SamplingConfig, make_backend
from grpo_stream.bench.gpu_presets import BENCH_CONFIG, presets_section
from grpo_stream.bench.gpu_saving import saving_section
from grpo_stream.tiny_model import build_tokenizer

if TYPE_CHECKING:
    from grpo_producers.backends.base import Dtype

# Dense (no sparsity) bf16 tensor-core peaks by GPU name. The H200 has the H100 SXM's compute (more memory only).
BF16_PEAK = {"H200": 989e12, "H100": 989e12}
# bf16 keeps 8 mantissa bits, so each rounding moves a logit by ~0.2-0.4%: a few 1e-3 of logprob on this model.
# A real mismatch (a token off by one, wrong positions under left padding, logits at the wrong temperature) moves
# |ratio - 1| by tens of percent (the shifted control below measures that on the same samples), so 0.05 on the
# mean separates the two with room on both sides. The max is printed, not asserted: bf16 has outliers.
RATIO_BOUND = 0.05
PAPER_CONFIG = "configs/paper/gsm8k-v1-i1.yaml"
ABSENT_THERE = ("vllm", "datasets", "math_verify")  # not installed on the GPU machine: must not be imported


@dataclass(frozen=True)
class Plan:
    name: str
    shape: dict[str, int]  # Qwen2Config's sizes
    device: str
    groups: int
    group_size: int
    completion_len: int
    prompt_len: tuple[int, int]
    steps: dict[int, tuple[int, int]]  # i -> (warm-up steps, timed steps)
    gen_prompts: int
    budget_s: float
    micro_batch_tokens: int | None = None  # None: the paper config's
    dtype: str = "bfloat16"
    temperature: float = 1.0
    presets: tuple[str, ...] = ()  # bench throughput's learner side per model preset (gpu_presets)


QWEN25_05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
              "intermediate_size": 4864, "vocab_size": 151936, "max_position_embeddings": 32768}
# An i = 10 step is ~31 forwards of 157k tokens: ~17 s at 25% MFU, so three of them fit the 5 minutes down to ~10%.
GPU = Plan("gpu", QWEN25_05B, "cuda", groups=28, group_size=16, completion_len=200, prompt_len=(100, 150),
           steps={1: (1, 3), 10: (1, 2)}, gen_prompts=8, budget_s=300.0, presets=("tiny", "50m", "qwen2.5-0.5b"))
SMOKE_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
               "intermediate_size": 128, "vocab_size": 320, "max_position_embeddings": 512}
SMOKE = Plan("smoke", SMOKE_SHAPE, "cpu", groups=4, group_size=4, completion_len=16,
             prompt_len=(8, 12), steps={1: (1, 1), 10: (0, 1)}, gen_prompts=2, budget_s=300.0,
             micro_batch_tokens=256, presets=("tiny",))  # two micro-batches per step: accumulation, as on the GPU


@dataclass
class Report:
    rows: list[tuple[str, str]] = field(default_factory=list)
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def row(self, label: str, value: str) -> None:
        self.rows.append((label, value))
        print(f"[gpu-check] {label}: {value}", file=sys.stderr, flush=True)  # progress, in case the run is cut

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append((name, ok, detail))

    def print(self) -> None:
        width = max(len(label) for label, _ in self.rows)
        print("== GPU check ==")
        for label, value in self.rows:
            print(f"{label:<{width}}  {value}")
        for name, ok, detail in self.checks:
            print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
        failed = sum(not ok for _, ok, _ in self.checks)
        print(f"gpu-check: {'FAIL' if failed else 'PASS'} ({len(self.checks) - failed}/{len(self.checks)} "
              "checks passed)")


# ---- model and data ---------------------------------------------------------------------------------------------
def build_model_dir(plan: Plan, out: Path) -> tuple[int, int]:
    """A random-weight Qwen2 of ``plan.shape`` plus the tiny byte-level tokenizer, saved as a hub checkpoint
    (what both the learner and the backend load). Returns (parameters, embedding parameters)."""
    eos = build_tokenizer(out, max_length=plan.shape["max_position_embeddings"]).eos_token_id
    # rope_parameters is transformers 5's spelling, rope_theta 4's (5 also reads it): both, then check it took.
    # rope_theta: not a field, taken by __post_init__(**kwargs) (the ignore); the shape's sizes go to int fields
    cfg = Qwen2Config(  # type: ignore[call-arg]
        **cast(dict[str, Any], plan.shape), tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
        bos_token_id=eos, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, eos_token_id=eos,
        pad_token_id=eos, use_cache=True)
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta != 1e6:
        raise RuntimeError(f"rope theta is {theta}, not 1e6: this transformers reads it elsewhere")
    torch.manual_seed(0)
    with torch.device(plan.device):  # initialising 0.5B parameters on the CPU would take a minute
        model = Qwen2ForCausalLM(cfg).to(DTYPES[plan.dtype])  # type: ignore[arg-type]  # @wraps'd .to (hf.py)
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    model.save_pretrained(out)
    counts = sum(p.numel() for p in model.parameters()), model.get_input_embeddings().weight.numel()
    del model
    free_memory()
    return counts


def scored_group(gid: str, members: list[wire.Completion], rewards: list[float]) -> wire.ScoredGroup:
    return wire.ScoredGroup(group_id=gid, prompt_id=gid.split("@")[0], task="gpu-check", policy_version=0,
                            completions=members, rewards=rewards, reward_mean=float(np.mean(rewards)),
                            reward_std=float(np.std(rewards)), verifier_id="gpu-check", group_size=len(members))


def completion(gid: str, index: int, size: int, prompt: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray,
               finish: str, temperature: float) -> wire.Completion:
    return wire.Completion(group_id=gid, index=index, group_size=size, prompt_id=gid.split("@")[0], task="gpu-check",
                           prompt_token_ids=prompt.astype(np.int32), completion_token_ids=tokens.astype(np.int32),
                           behaviour_logprobs=logprobs.astype(np.float32), policy_version=0, producer_id="gpu-check",
                           finish_reason=finish, logprob_temperature=temperature)


def through_wire(groups: list[wire.ScoredGroup]) -> list[wire.ScoredGroup]:
    """What the learner would read off the groups topic: encoded, decoded and validated."""
    return [wire.decode(wire.encode(g), wire.ScoredGroup) for g in groups]


def synthetic_groups(plan: Plan, rng: np.random.Generator) -> list[wire.ScoredGroup]:
    """Training groups: random tokens, behaviour logprobs near the random model's (about -log V), 0/1 rewards."""
    v, t = plan.shape["vocab_size"], plan.completion_len
    groups = []
    for g in range(plan.groups):
        gid = wire.make_group_id(f"train-{g}", 0)
        prompt = rng.integers(1, v, int(rng.integers(plan.prompt_len[0], plan.prompt_len[1] + 1)))
        members = [completion(gid, k, plan.group_size, prompt, rng.integers(1, v, t),
                              np.minimum(-math.log(v) + rng.normal(0.0, 0.5, t), 0.0), "length", plan.temperature)
                   for k in range(plan.group_size)]
        groups.append(scored_group(gid, members, [float(r) for r in rng.integers(0, 2, plan.group_size)]))
    return through_wire(groups)


def learner_config(plan: Plan, paper_config: Path, model_dir: Path, i: int) -> LearnerConfig:
    """The paper's learner section with this check's model, device and batch shape (and i)."""
    run = read_yaml(paper_config)
    raw = dict(run["learner"])
    raw["pipeline"] = {**run.get("pipeline", {}), "group_size": plan.group_size, "max_new_tokens": plan.completion_len}
    raw["model"] = {**raw.get("model", {}), "path": str(model_dir), "device": plan.device, "dtype": plan.dtype}
    raw.update(groups_per_batch=plan.groups, grad_steps_per_batch=i)
    if plan.micro_batch_tokens:
        raw["micro_batch_tokens"] = plan.micro_batch_tokens
    cfg = build(LearnerConfig, raw, "")
    validate_tree(cfg)
    return cfg


# ---- measuring ---------------------------------------------------------------------------------------------------
def make_sync(device: str) -> Callable[..., None]:
    return (lambda *_: torch.cuda.synchronize()) if device.startswith("cuda") else (lambda *_: None)


def add_sync_hooks(model: torch.nn.Module, sync: Callable[..., None]) -> None:
    """Make the trainer's perf_counter split mean GPU time. It synchronises only where it reads a value: the
    forward's kernels would finish inside "backward" (its isfinite read), the backward's in the next forward.
    Syncing after each vocabulary projection (the forward's last big op) and after the tied embedding's gradient
    is accumulated (the backward's last op) puts each phase's kernels in its own bucket. Installed before the
    Trainer copies the reference model, so the reference forward ("forward_old") is synced too."""
    cast(Any, model).get_output_embeddings().register_forward_hook(sync)
    cast(Any, model).get_input_embeddings().weight.register_post_accumulate_grad_hook(sync)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_memory(device: str) -> str:
    if device.startswith("cuda"):
        return (f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated "
                f"({torch.cuda.max_memory_reserved() / 2**30:.2f} GiB reserved)")
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB (process peak RSS; cpu)"


def bf16_peak(device: str, override_tflops: float | None) -> tuple[float | None, str]:
    if override_tflops:
        return override_tflops * 1e12, f"{override_tflops:g} TFLOP/s (--peak-tflops)"
    if not device.startswith("cuda"):
        return None, "no bf16 peak known for cpu (--peak-tflops)"
    name = torch.cuda.get_device_name()
    for key, peak in BF16_PEAK.items():
        if key in name:
            return peak, f"{peak / 1e12:g} TFLOP/s ({key} dense bf16, from the name {name!r})"
    return None, f"no bf16 peak known for {name!r} (--peak-tflops)"


def step_flops(params: int, embed: int, tokens_all: int, tokens_comp: int, i: int, nograd: int) -> float:
    """Model FLOPs of one learner step: 2 per parameter per token forward, 4 more backward. The body sees every
    token; the (tied) vocabulary projection only completion tokens (learner/logprobs.py); embedding lookups cost
    nothing. Left out: attention scores (~2% at 350 tokens) and recomputation (hardware, not model, FLOPs)."""
    forward = 2 * (params - embed) * tokens_all + 2 * embed * tokens_comp
    return (3 * i + nograd) * forward


def timed_step(trainer: Trainer, groups: list[wire.ScoredGroup], sync: Callable[..., None]) -> tuple[StepStats, float]:
    sync()
    t0 = time.perf_counter()
    stats = trainer.train_step(groups)
    sync()
    return stats, time.perf_counter() - t0


# ---- the sections ------------------------------------------------------------------------------------------------
def train_section(plan: Plan, cfg: LearnerConfig, groups: list[wire.ScoredGroup], counts: tuple[int, int],
                  deadline: float, peak: tuple[float | None, str], report: Report) -> None:
    i = cfg.grad_steps_per_batch
    warmup, timed = plan.steps[i]
    free_memory()
    sync = make_sync(plan.device)
    model = load_model(cfg.model)
    add_sync_hooks(model, sync)
    trainer = Trainer(cfg, model)
    trainer.optimizer.register_step_post_hook(sync)  # optimizer.step()'s kernels are never read back otherwise
    runs = [timed_step(trainer, groups, sync) for _ in range(warmup)]
    warm_s = runs[-1][1] if runs else 0.0
    # Each timed step costs about what the warm-up did: take fewer rather than run past the budget.
    n = max(1, min(timed, int((deadline - time.monotonic()) / warm_s))) if warm_s else timed
    runs += [timed_step(trainer, groups, sync) for _ in range(n)]
    timed_runs = runs[warmup:]
    wall = sum(w for _, w in timed_runs) / n
    split = {k: sum(s.timings.get(k, 0.0) for s, _ in timed_runs) / n
             for k in ("collate", "forward_old", "forward", "backward", "optimizer")}
    tokens_all = sum(len(c.prompt_token_ids) + len(c.completion_token_ids) for g in groups for c in g.completions)
    tokens_comp = timed_runs[0][0].tokens
    nograd = int(cfg.loss.requires_proximal()) + int(cfg.loss.requires_ref())
    flops = step_flops(*counts, tokens_all, tokens_comp, i, nograd)
    mfu = f"{flops / wall / peak[0]:.1%}" if peak[0] else "n/a"
    label = f"i={i}"
    warm = f" of {warm_s:.3f} s" if warmup else ""
    report.row(f"{label} step time", f"{wall:.3f} s (mean of {n} timed step(s) after {warmup} warm-up{warm}; "
                                     f"{len(microbatches_of(cfg, groups))} micro-batches per grad step)")
    report.row(f"{label} split", " | ".join(f"{k} {v:.3f}" for k, v in split.items())
               + f" | other {wall - sum(split.values()):.3f} s (forward/backward/optimizer: over the {i} grad steps)")
    report.row(f"{label} tokens/s", f"{tokens_all * i / wall:,.0f} through fwd+bwd (prompt+completion); batch: "
                                    f"{tokens_comp / wall:,.0f} completion tokens/s, {len(groups) / wall:.2f} groups/s")
    report.row(f"{label} peak memory", peak_memory(plan.device))
    report.row(f"{label} MFU", f"{mfu}: {flops / wall / 1e12:.3g} TFLOP/s of model FLOPs ({3 * i} + {nograd} forward "
                               f"passes per step) over {peak[1]}")
    losses = [s.metrics.get("loss", float("nan")) for s, _ in runs]
    skipped = sum(s.skipped_updates for s, _ in runs)
    report.check(f"{label} train steps", skipped == 0 and all(math.isfinite(x) for x in losses),
                 f"{len(runs)} steps, losses {', '.join(f'{x:.4g}' for x in losses)}, {skipped} skipped updates")
    report.data[label] = {"step_s": wall, "split_s": split, "tokens_all": tokens_all, "tokens_completion": tokens_comp,
                          "model_tflops_per_s": flops / wall / 1e12, "mfu": flops / wall / peak[0] if peak[0] else None}
    del trainer, model
    free_memory()


def microbatches_of(cfg: LearnerConfig, groups: list[wire.ScoredGroup]) -> list[Any]:
    zeros = [torch.zeros(len(g.completions)) for g in groups]
    return microbatches(collate(groups, zeros, 0), cfg.micro_batch_tokens)


def generation_section(plan: Plan, cfg: LearnerConfig, rng: np.random.Generator, report: Report) -> None:
    backend = make_backend(BackendConfig(model=cfg.model.path, kind="hf", dtype=cast("Dtype", plan.dtype),
                                         device=plan.device, max_batch_prompts=plan.gen_prompts, logprobs="sampling"))
    prompts = [rng.integers(1, plan.shape["vocab_size"], int(rng.integers(plan.prompt_len[0], plan.prompt_len[1] + 1)))
               for _ in range(plan.gen_prompts)]
    sampling = SamplingConfig(temperature=plan.temperature, max_tokens=plan.completion_len)
    sync = make_sync(plan.device)
    backend.generate([prompts[0].tolist()], 2, dataclasses.replace(sampling, max_tokens=4))  # kernels, allocator
    free_memory()
    sync()
    t0 = time.perf_counter()
    samples = backend.generate([p.tolist() for p in prompts], plan.group_size, sampling)
    sync()
    wall = time.perf_counter() - t0
    backend.close()
    tokens = sum(len(s.token_ids) for group in samples for s in group)
    report.row("generation", f"HF backend, {plan.gen_prompts} prompts x G={plan.group_size}, up to "
                             f"{plan.completion_len} tokens, T={plan.temperature:g}: {tokens} tokens in {wall:.2f} s")
    report.row("generation tokens/s", f"{tokens / wall:,.0f}")
    report.row("generation peak memory", peak_memory(plan.device))
    report.check("generation", all(len(g) == plan.group_size for g in samples) and tokens > 0,
                 f"{len(samples)} prompts x {plan.group_size} samples, {tokens} tokens")
    report.data["generation"] = {"tokens": tokens, "s": wall, "tokens_per_s": tokens / wall}
    groups = []
    for p, (prompt, group) in enumerate(zip(prompts, samples, strict=True)):
        gid = wire.make_group_id(f"gen-{p}", 0)
        members = [completion(gid, k, len(group), prompt, s.token_ids, s.logprobs, s.finish_reason, plan.temperature)
                   for k, s in enumerate(group)]
        groups.append(scored_group(gid, members, [0.0] * len(group)))
    ratio_section(cfg, through_wire(groups), report)


@torch.no_grad()
def ratio_section(cfg: LearnerConfig, groups: list[wire.ScoredGroup], report: Report) -> None:
    """pi_learner / pi_behaviour on the backend's own samples, same weights: 1 up to bf16 rounding."""
    model = load_model(cfg.model).eval()
    diffs, shifted = [], []
    for mb in microbatches_of(cfg, groups):
        mb = mb.to(cfg.model.device)
        lp, blp, mask = completion_logprobs(model, mb), mb.behaviour_logprobs, mb.completion_mask.bool()
        diffs.append((lp - blp)[mask])
        # Control: each token against its neighbour's behaviour logprob, the error an alignment bug would make.
        shifted.append((lp[:, 1:] - blp[:, :-1])[mask[:, 1:]])
    del model
    free_memory()
    dev = (torch.cat(diffs).double().exp() - 1).abs()
    control = float((torch.cat(shifted).double().exp() - 1).abs().mean())
    mean, top, p99 = float(dev.mean()), float(dev.max()), float(torch.quantile(dev, 0.99))
    report.row("ratio |r-1| mean", f"{mean:.2e} over {dev.numel()} tokens (bound {RATIO_BOUND})")
    report.row("ratio |r-1| max", f"{top:.2e} (p99 {p99:.2e})")
    report.row("ratio control (1-token shift)", f"{control:.2e} (must exceed the bound)")
    report.check("on-policy ratio", mean < RATIO_BOUND, f"mean |r-1| {mean:.2e} < {RATIO_BOUND}")
    report.check("ratio control", control > RATIO_BOUND, f"misaligned mean |r-1| {control:.2e} > {RATIO_BOUND}")
    report.data["ratio"] = {"mean_abs": mean, "max_abs": top, "p99_abs": p99, "control_mean_abs": control}


def imports_row(report: Report) -> None:
    where = {m: str(Path(sys.modules[m].__file__ or "?").parent) for m in ("grpo_learner", "grpo_producers", "kafka")
             if m in sys.modules}
    report.row("imports", "; ".join(f"{m} {path}" for m, path in where.items()))
    loaded = [m for m in ABSENT_THERE if m in sys.modules]
    report.check("imports", not loaded, f"none of {', '.join(ABSENT_THERE)} imported (absent on the GPU machine)"
                 if not loaded else f"imported {loaded}: the GPU machine does not have them")


# ---- main --------------------------------------------------------------------------------------------------------
def run(plan: Plan, paper_config: Path, peak_tflops: float | None, report: Report,
        bench_config: Path = Path(BENCH_CONFIG)) -> None:
    start = time.monotonic()
    device = torch.cuda.get_device_name() if plan.device.startswith("cuda") else "cpu"
    report.row("device", f"{device} ({plan.device}, {plan.dtype}), torch {torch.__version__}")
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        counts = build_model_dir(plan, Path(tmp))
        report.row("model", f"Qwen2 {', '.join(f'{k} {v}' for k, v in plan.shape.items())}: {counts[0] / 1e6:.1f}M "
                            "parameters (random weights, tied embeddings, rope theta 1e6)")
        cfgs = {i: learner_config(plan, paper_config, Path(tmp), i) for i in plan.steps}
        base = cfgs[min(cfgs)]
        report.row("learner config", f"{paper_config.name}: loss {base.loss.variant} beta {base.loss.beta:g}, "
                                     f"micro_batch_tokens {base.micro_batch_tokens}, lr {base.optim.lr:g}")
        guarded(report, "generation", lambda: generation_section(plan, base, rng, report))
        # before the i sections: they share out whatever is left of the budget
        guarded(report, "presets", lambda: presets_section(plan, bench_config, report))
        groups = synthetic_groups(plan, rng)
        report.row("train batch", f"{len(groups)} groups x G={plan.group_size}, completions {plan.completion_len} "
                                  f"tokens, prompts {plan.prompt_len[0]}-{plan.prompt_len[1]} tokens")
        peak = bf16_peak(plan.device, peak_tflops)
        # Before the i sections, with a share of the budget like each of theirs (a third: i = 1, i = 10 and this).
        deadline = start + plan.budget_s - 10.0
        guarded(report, "saving", lambda: saving_section(
            plan, base, groups, time.monotonic() + (deadline - time.monotonic()) / (len(cfgs) + 1), report))
        for n, (i, cfg) in enumerate(sorted(cfgs.items())):
            # Leave each later i its share of what is left of the budget.
            deadline = start + plan.budget_s - 10.0
            share = time.monotonic() + (deadline - time.monotonic()) / (len(cfgs) - n)
            # (mypy cannot infer a lambda with a default argument: the ignore below)
            guarded(report, f"i={i} train", lambda c=cfg, d=share: train_section(  # type: ignore[misc]
                plan, c, groups, counts, d, peak, report))
    imports_row(report)
    wall = time.monotonic() - start
    report.row("wall time", f"{wall:.1f} s after the imports (budget {plan.budget_s:.0f} s)")
    report.check("time", wall < plan.budget_s, f"{wall:.1f} s < {plan.budget_s:.0f} s")


def guarded(report: Report, name: str, fn: Callable[[], None]) -> None:
    """A failing section is a failed check; the others still run (a GPU session is too short to rerun for each)."""
    try:
        fn()
    except Exception as exc:
        traceback.print_exc()
        report.check(name, False, f"{type(exc).__name__}: {exc}")
        free_memory()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU in seconds (the test suite's mode)")
    ap.add_argument("--paper-config", type=Path, default=Path(PAPER_CONFIG), help="run YAML whose learner section "
                    "is used (default: %(default)s, relative to the working directory)")
    ap.add_argument("--bench-config", type=Path, default=Path(BENCH_CONFIG), help="bench throughput's run YAML "
                    "(its learner section times the presets; default: %(default)s)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="bf16 peak for the MFU (default: by GPU name)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures as JSON here")
    args = ap.parse_args(argv)
    plan = SMOKE if args.smoke else GPU
    if plan.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu-check: no CUDA device (use --smoke for the CPU mode)", file=sys.stderr)
        return 2
    report = Report()
    guarded(report, "set-up", lambda: run(plan, args.paper_config, args.peak_tflops, report, args.bench_config))
    report.print()
    if args.json:
        args.json.write_text(json.dumps({"plan": plan.name, "rows": dict(report.rows), **report.data,
                                         "checks": {n: ok for n, ok, _ in report.checks}}, indent=2) + "\n")
    return 0 if all(ok for _, ok, _ in report.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
