"""The ``grpo-stream`` command line: thin wrappers that parse arguments and call into the package."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable

from grpo_core.config import ConfigError, InputError

Handler = Callable[[argparse.Namespace], int]


def _kafka(args: argparse.Namespace) -> int:
    from grpo_stream.broker import LocalBroker

    broker = LocalBroker(data_dir=args.data_dir, port=args.port, controller_port=args.controller_port,
                         libs_dir=args.jars)
    if args.action == "up":
        state = broker.up(fresh=args.fresh, timeout_s=args.timeout)
        print(f"kafka is up: bootstrap {state['bootstrap']} (pid {state['pid']}, data {broker.data_dir})")
    elif args.action == "down":
        stopped = broker.down(timeout_s=args.timeout)
        print("kafka stopped" if stopped else "kafka was not running")
    else:
        print(json.dumps(broker.status()))
    return 0


def _kafka_tool(args: argparse.Namespace) -> int:
    from grpo_stream.kafka_tools import run_tool

    return run_tool(args.name, list(args.args), args.jars)


def _topics(args: argparse.Namespace) -> int:
    from grpo_core.config import load_config
    from grpo_core.kafka_io import make_admin
    from grpo_core.topics import TopicsFileConfig, ensure_topics

    cfg = load_config(TopicsFileConfig, args.config, args.overrides, ignore_unknown_top=True,
                      pipeline_file=args.pipeline)
    admin = make_admin(cfg.kafka)
    try:
        for result in ensure_topics(admin, cfg.pipeline):
            print(f"{result.name}: {'created' if result.created else 'exists, matches the plan'}")
    finally:
        admin.close()
    return 0


# The service roles: help and an example override (their modules: grpo_stream.roles).
ROLES: dict[str, tuple[str, str]] = {
    "learner": ("train on scored groups; publish weights; checkpoint", "publish_every=10"),
    "producer": ("generate G completions per prompt with hot-swapped weights", "backend.kind=vllm"),
    "verifier": ("score completions, assemble groups, publish ScoredGroups", "rewards.workers=4"),
    "feed": ("publish a dataset's prompts to the prompts topic (resumable)", "epochs=2"),
}


def _role(args: argparse.Namespace) -> int:
    from grpo_core.config import check_paths, load_config
    from grpo_stream.roles import ROLE_MODULES, config_class

    # The config first, then the role: its module imports torch, transformers or vLLM (seconds), and a mistyped
    # key or a missing model directory is reported before any of that. The role's main loads it again (cheap).
    check_paths(load_config(config_class(args.command), args.config, args.overrides, pipeline_file=args.pipeline))
    module = importlib.import_module(ROLE_MODULES[args.command][0])
    return module.main(args.config, args.overrides, args.pipeline)


def _config(args: argparse.Namespace) -> int:
    from grpo_core.config import explain
    from grpo_stream.roles import config_class

    if args.action == "reference":
        from grpo_stream import config_reference

        return config_reference.main(args.check)
    if args.role is None:
        raise ConfigError("config explain: name a role, e.g. `config explain learner`")
    for line in explain(config_class(args.role)):
        print(line)
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.what == "learner":
        from grpo_stream.bench import learner

        return learner.main(bootstrap=args.bootstrap, steps=args.steps or 5)
    if args.what == "verifier":
        from grpo_stream.bench import verifier

        return verifier.main(bootstrap=args.bootstrap)
    if args.what == "producer":
        from grpo_stream.bench import producer

        return producer.main(bootstrap=args.bootstrap)
    if args.what == "engine":
        from grpo_stream.bench import engine

        return engine.main(seconds=args.budget or 20.0, repeats=args.repeats or 3, lengths=args.lengths,
                           out=args.out or "runs/bench-engine", batch=args.batch)
    if args.what == "predict":
        from grpo_stream.bench import predict

        if not args.throughput:
            raise ConfigError("bench predict: --throughput names the bench throughput JSON to read steps/s from")
        return predict.main(args.throughput, args.runs, args.arm, args.target)
    if args.what == "throughput":
        from grpo_stream.bench import throughput

        return throughput.main(preset=(args.preset or ["50m"])[-1], demo=args.demo, dist=args.length_dist,
                               median=args.median, p99_ratio=args.p99_ratio, group_size=args.group_size or 8,
                               prompts=args.prompts or 2, max_tokens=args.max_tokens, repeats=args.repeats or 3,
                               warmup=args.warmup, steps=args.steps, budget_s=args.budget or 900.0, arms=args.arms,
                               short=args.short, out=args.out or "runs/bench-throughput")
    if args.what == "async":
        from grpo_stream.bench import async_bench

        return async_bench.main(budget_s=args.budget or 90.0, repeats=args.repeats or 1, target=args.target,
                                short=args.short, out=args.out or "runs/bench-async", arms=args.arms,
                                task=args.task)
    if args.what == "publish":
        from grpo_stream.bench import saving_cost

        return saving_cost.main(presets=args.preset, arms=args.arms, short=args.short, warmup=args.warmup,
                                steps=args.steps, repeats=args.repeats or 3, checkpoint_every=args.checkpoint_every,
                                group_size=args.group_size, groups=args.prompts, completion_len=args.completion_tokens,
                                publish_dtype=args.publish_dtype, bootstrap=args.bootstrap,
                                out=args.out or "runs/bench-publish")
    from grpo_stream.bench import wire

    return wire.main(seconds=args.seconds, bootstrap=args.bootstrap, kafka_records=args.records)


def _run(args: argparse.Namespace) -> int:
    from grpo_stream.run import main

    return main(args.config, args.overrides)


def _inspect(args: argparse.Namespace) -> int:
    from grpo_stream import inspect_run

    return inspect_run.main(args.run_dir, step=args.step, group=args.group, as_json=args.json)


def _report(args: argparse.Namespace) -> int:
    from grpo_stream.report import write_comparison, write_report

    print(write_comparison([args.run_dir, *args.compare]) if args.compare else write_report(args.run_dir))
    return 0


def _replay(args: argparse.Namespace) -> int:
    from grpo_stream import replay

    return replay.main(args.run_dir, args.out, args.overrides, args.ablation)


def _k8s(args: argparse.Namespace) -> int:
    from grpo_stream.k8s import main

    return main([args.action, *args.rest])


def _dashboards(args: argparse.Namespace) -> int:
    from grpo_stream.dashboards import main

    return main(check=args.check, root=args.root)


def _sweep(args: argparse.Namespace) -> int:
    from grpo_stream.sweep import main

    return main(args.config, args.overrides)


def _chaos(args: argparse.Namespace) -> int:
    from grpo_stream.chaos import main

    return main(seed=args.seed, prompts=args.prompts, minutes=args.minutes, out=args.out, overrides=args.overrides)


def _demo(args: argparse.Namespace) -> int:
    from grpo_stream.demo import main

    return main(backend=args.backend, minutes=args.minutes, seed=args.seed, out=args.out, until=args.until)


def _reward_or_off(text: str) -> float | None:
    if text.lower() in ("off", "none"):
        return None
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"--until {text}: a held-out reward in (0, 1], or 'off'")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpo-stream", description="Streaming off-policy GRPO on Apache Kafka.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    k = sub.add_parser("kafka", help="the local single-node Kafka broker (KRaft)")
    k.add_argument("action", choices=["up", "down", "status"])
    k.add_argument("--port", type=int, default=9092, help="client port (controller uses port+1)")
    k.add_argument("--controller-port", type=int, default=None, help="KRaft controller port (default port+1)")
    k.add_argument("--data-dir", default=None,
                   help="broker data dir (default $GRPO_STREAM_KAFKA_DATA, else .cache/kafka/data; persistent)")
    k.add_argument("--jars", default=None, help="the Kafka jars (default $GRPO_STREAM_KAFKA_LIBS, else "
                                                ".cache/kafka/libs, where ops/setup.sh puts them)")
    k.add_argument("--fresh", action="store_true", help="wipe the data dir before starting")
    k.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for start/stop")
    k.set_defaults(fn=_kafka)

    kt = sub.add_parser("kafka-tool", help="Kafka's operator tools: consumer-groups, topics, console-consumer, "
                                           "get-offsets (arguments as for Kafka's bin/kafka-*.sh)")
    kt.add_argument("--jars", default=None, help="the Kafka jars (default $GRPO_STREAM_KAFKA_LIBS, .cache/kafka/libs)")
    kt.add_argument("name", choices=["consumer-groups", "topics", "console-consumer", "get-offsets"])
    kt.add_argument("args", nargs=argparse.REMAINDER,
                    help="the tool's arguments; --bootstrap-server defaults to $KAFKA_BOOTSTRAP, else 127.0.0.1:9092")
    kt.set_defaults(fn=_kafka_tool)

    t = sub.add_parser("topics", help="create the declared topic plan (idempotent)")
    t.add_argument("action", choices=["create"])
    t.add_argument("--config", default=None, help="YAML with kafka: and pipeline: sections (any role's config)")
    t.add_argument("--pipeline", default=None, help="the pipeline contract file (instead of a pipeline: section)")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. pipeline.topics.groups.partitions=8")
    t.set_defaults(fn=_topics)

    for role, (text, example) in ROLES.items():
        role_parser = sub.add_parser(role, help=text)
        role_parser.add_argument("--config", default=None, help=f"YAML (see configs/; `config explain {role}`)")
        role_parser.add_argument("--pipeline", default=None,
                                 help="the pipeline contract every role loads (configs/pipeline.yaml; `config explain "
                                      "pipeline`), instead of a pipeline: section in --config")
        role_parser.add_argument("overrides", nargs="*", help=f"key=value overrides, e.g. {example}")
        role_parser.set_defaults(fn=_role)

    c = sub.add_parser("config", help="explain every config key of a role; write/check docs/configuration.md")
    c.add_argument("action", choices=["explain", "reference"])
    c.add_argument("role", nargs="?", choices=["pipeline", "topics", "learner", "producer", "feeder", "verifier"])
    c.add_argument("--check", action="store_true", help="reference: exit 1 if docs/configuration.md is stale")
    c.set_defaults(fn=_config)

    b = sub.add_parser("bench", help="benchmarks that print measured figures")
    b.add_argument("what", choices=["wire", "learner", "producer", "verifier", "async", "engine", "throughput",
                                    "predict", "publish"])
    b.add_argument("runs", nargs="*", help="predict: learning runs (demo or sweep run directories) to check")
    b.add_argument("--seconds", type=float, default=3.0, help="time per measurement")
    b.add_argument("--bootstrap", default=None, help="external cluster; default: a temporary local broker")
    b.add_argument("--records", type=int, default=2000, help="wire: ScoredGroups for the produce->consume test")
    b.add_argument("--steps", type=int, default=None, help="learner: timed steps per model (5); throughput: "
                                                             "measured learner steps per arm, after --warmup (a "
                                                             "preset 4, --demo 150); publish: timed steps per arm (10)")
    b.add_argument("--budget", type=float, default=None,
                   help="async: seconds per arm from its first token (default 90); engine: seconds per run (20); "
                        "throughput: the most seconds an arm may take, start-up included (900)")
    b.add_argument("--repeats", type=int, default=None,
                   help="async, engine, throughput: runs of every arm, interleaved (min/median/max; default 1, "
                        "engine, throughput and publish 3)")
    b.add_argument("--batch", type=int, default=None, help="engine: groups per batch and in flight (default: "
                                                          "groups_per_batch of configs/bench-async.yaml, 16)")
    b.add_argument("--lengths", default="1-8", help="engine: digit counts of the copy prompts, a range (1-8) or a "
                                                   "list to draw from (1,1,2,12: a repeat is a weight)")
    b.add_argument("--target", type=float, default=0.6, help="async, predict: the held-out reward timed to")
    b.add_argument("--throughput", default=None, help="predict: a bench throughput JSON (steps/s per arm)")
    b.add_argument("--arm", default="P demo", help="predict: the throughput arm whose steps/s the runs had")
    b.add_argument("--task", default="copy_short", help="async: the multi-token synthetic family every arm learns "
                                                         "(copy_short: 1-4 digits; copy: 1-8, the longer tail)")
    b.add_argument("--short", action="store_true", help="async: arms S and P v1 inflight only (a smoke run); "
                                                        "throughput, publish: every arm, tiny preset, 1+3 steps, "
                                                        "1 repeat")
    b.add_argument("--preset", action="append", default=None, choices=["tiny", "50m", "qwen2.5-0.5b"],
                   help="throughput: the model (random weights; qwen2.5-0.5b: Qwen2.5-0.5B's shape; default 50m); "
                        "publish: repeatable (default 50m and qwen2.5-0.5b)")
    b.add_argument("--demo", action="store_true", help="throughput: the demo's task, model and configs/demo.yaml "
                                                       "(arms S, S-hybrid, P demo, TRL) instead of a preset")
    b.add_argument("--length-dist", default="lognormal", choices=["lognormal", "fixed", "model"],
                   help="throughput: completion lengths (EOS ignored; model: the model's own)")
    b.add_argument("--median", type=int, default=64, help="throughput: median completion length in tokens")
    b.add_argument("--p99-ratio", type=float, default=8.0, help="throughput: lognormal p99 / median (the tail)")
    b.add_argument("--max-tokens", type=int, default=512, help="throughput: the cap of the drawn lengths")
    b.add_argument("--group-size", type=int, default=None, help="throughput: G (8); publish: G (4)")
    b.add_argument("--prompts", type=int, default=None, help="throughput, publish: prompts (groups) per learner "
                                                             "step (throughput 2, publish 1)")
    b.add_argument("--completion-tokens", type=int, default=None, help="publish: tokens per completion (32)")
    b.add_argument("--checkpoint-every", type=int, default=None, help="publish: steps between checkpoints (10)")
    b.add_argument("--publish-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="publish: the learner's publish_dtype")
    b.add_argument("--warmup", type=int, default=None,
                   help="throughput: learner steps per arm before the clock (a preset 1, --demo 20); publish: 2")
    b.add_argument("--out", default=None, help="async, engine, throughput, publish: output directory "
                                               "(runs/bench-<what>)")
    b.add_argument("--arms", default=None, help="async, throughput: only these arms, comma-separated (S, "
                                                "S-hybrid, P-v1-between, P-v1-inflight, P-v4-between, "
                                                "P-v4-inflight; async: S-lag2 only when named; throughput: TRL, "
                                                "and with --demo P-demo; publish: none, sync, async, "
                                                "async+ckpt-on-publish)")
    b.set_defaults(fn=_bench)

    r = sub.add_parser("run", help="a whole pipeline (feeder, producers, verifiers, learner) as supervised processes")
    r.add_argument("config", help="run YAML (e.g. configs/demo.yaml)")
    r.add_argument("overrides", nargs="*", help="key=value overrides, e.g. producers.count=2 learner.max_steps=50")
    r.set_defaults(fn=_run)

    rp = sub.add_parser("report", help="rebuild report.png of a run directory")
    rp.add_argument("run_dir", help="runs/<name>")
    rp.add_argument("--compare", nargs="+", default=None, metavar="DIR",
                    help="overlay these runs with RUN_DIR (reward and loss vs step) into RUN_DIR/compare.png")
    rp.set_defaults(fn=_report)

    rl = sub.add_parser("replay", help="train a fresh learner on a run's recorded groups (no generation)")
    rl.add_argument("run_dir", help="runs/<name>")
    rl.add_argument("--ablation", action="store_true",
                    help="re-batch the trained groups under the overrides (default: exact, no overrides)")
    rl.add_argument("--out", default=None, help="output run directory (default RUN_DIR-replay[-ablation])")
    rl.add_argument("overrides", nargs="*", help="ablation: learner key=value overrides")
    rl.set_defaults(fn=_replay)

    ins = sub.add_parser("inspect", help="what the learner trained on, read back from a run's lineage and topics")
    ins.add_argument("run_dir", help="runs/<name>")
    view = ins.add_mutually_exclusive_group()
    view.add_argument("--step", type=int, default=None, help="the groups trained and dropped at this learner step")
    view.add_argument("--group", default=None, help="one group id end to end (prompt -> completions -> step)")
    view.add_argument("--summary", action="store_true", help="per step range, and dead letters (the default)")
    ins.add_argument("--json", action="store_true", help="JSON instead of text tables")
    ins.set_defaults(fn=_inspect)

    k8 = sub.add_parser("k8s", help="generate/check ops/k8s files derived from configs/ (topics, ConfigMaps)")
    k8.add_argument("action", choices=["generate", "check", "topics"])
    k8.add_argument("rest", nargs=argparse.REMAINDER, help="topics: --config FILE [key=value ...]")
    k8.set_defaults(fn=_k8s)

    sw = sub.add_parser("sweep", help="a grid of real runs (the paper's v/i arms) x seeds -> sweep.png, sweep.md")
    sw.add_argument("config", help="sweep YAML (e.g. configs/sweeps/paper-grid.yaml)")
    sw.add_argument("overrides", nargs="*", help="key=value overrides of the sweep file (seeds=[0], ...)")
    sw.set_defaults(fn=_sweep)

    db = sub.add_parser("dashboards", help="write ops/grafana/dashboards/*.json from the roles' metrics (Grafana's "
                        "SDK); --check: fail when the committed files differ")
    db.add_argument("--check", action="store_true", help="compare only; exit 1 with a diff when a file differs")
    db.add_argument("--root", default=".", help="the checkout (default: the working directory)")
    db.set_defaults(fn=_dashboards)

    d = sub.add_parser("demo", help="a tiny model learning through the whole pipeline on this CPU (no arguments)")
    d.add_argument("--backend", choices=["hf", "vllm"], default="hf", help="producers' generation backend")
    d.add_argument("--minutes", type=float, default=8.0,
                   help="time budget (at most 15), warm start and evals included: the upper bound")
    from grpo_stream.demo import DEFAULT_UNTIL, HOLD  # light: the demo's heavy imports are inside functions

    d.add_argument("--until", type=_reward_or_off, default=DEFAULT_UNTIL, metavar="REWARD",
                   help=f"end once the held-out reward is >= REWARD for {HOLD} evaluations in a row (default "
                        f"{DEFAULT_UNTIL}; 'off': run the whole budget)")
    d.add_argument("--seed", type=int, default=0, help="model, data and sampling seed")
    d.add_argument("--out", default=None, help="run directory (default runs/demo-seed<SEED>)")
    d.set_defaults(fn=_demo)

    ch = sub.add_parser("chaos", help="kill -9 every role, restart the broker, inject poison records, rescale; "
                                      "then reconcile (exit 1 if a promise broke)")
    ch.add_argument("--seed", type=int, default=0, help="the schedule's order and steps, and the junk bytes")
    ch.add_argument("--prompts", type=int, default=256, help="size of the finite feed")
    ch.add_argument("--minutes", type=float, default=10.0, help="upper bound of the whole run")
    ch.add_argument("--out", default=None, help="run directory (default runs/chaos-seed<SEED>)")
    ch.add_argument("overrides", nargs="*", help="key=value overrides of configs/chaos.yaml")
    ch.set_defaults(fn=_chaos)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # key=value overrides may follow options (`topics create --config f.yaml a.b=1`), which argparse's
    # positional matching does not allow; collect the leftovers for the commands that take overrides.
    args, extra = parser.parse_known_args(argv)
    # the same for `bench predict`'s run directories after its options (`--target 0.95 runs/a runs/b`)
    if extra and hasattr(args, "runs") and not any(e.startswith("-") for e in extra):
        args.runs, extra = [*args.runs, *extra], []
    if extra and (not hasattr(args, "overrides") or any("=" not in e or e.startswith("-") for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        configure_logging(args.verbose)
        return args.fn(args)
    except Exception as exc:
        if not isinstance(exc, _input_errors()):
            raise
        print(f"grpo-stream {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


KAFKA_LOG_ENV = "GRPO_STREAM_KAFKA_LOG_LEVEL"


def configure_logging(verbose: bool) -> None:
    """INFO (DEBUG with -v) for our loggers. kafka-python's stay at CRITICAL unless $GRPO_STREAM_KAFKA_LOG_LEVEL
    names another level: it logs every failed connection at ERROR, dozens of lines per second of a broker
    outage, and every failure that matters reaches our code, which reports it once (grpo_core.kafka_connect)."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name = os.environ.get(KAFKA_LOG_ENV, "").strip().upper() or ("DEBUG" if verbose else "CRITICAL")
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        raise ConfigError(f"${KAFKA_LOG_ENV}: {name!r} is not a logging level (DEBUG, INFO, WARNING, ERROR, "
                          f"CRITICAL)")
    logging.getLogger("kafka").setLevel(level)


def _input_errors() -> tuple[type[BaseException], ...]:
    """The errors that are the user's to fix (one line, exit 2). Looked up among the modules already imported:
    importing one to check would cost a role its fast start, and an error cannot come from a module not loaded."""
    found: list[type[BaseException]] = [InputError]
    for module, name in (("grpo_core.topics", "TopicConflict"), ("grpo_stream.broker", "BrokerError")):
        if module in sys.modules:
            found.append(getattr(sys.modules[module], name))
    return tuple(found)


if __name__ == "__main__":
    sys.exit(main())
