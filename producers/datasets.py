"""Dataset sources for the feeder: each turns its config section into a stream of :class:`DatasetItem`.

Sources (``FeederConfig.source`` picks one from :data:`LOADERS`):

* ``jsonl`` -- JSON Lines files (GSM8K-style ``{"question": ..., "answer": ...}``). A bad line is reported
  through ``on_bad`` with its ``file:line`` and skipped: one broken line never stops a feed.
* ``hf`` -- a *local* Hugging Face ``datasets`` directory or data file (no hub access); needs ``datasets``.
* ``synthetic`` -- tiny built-in tasks with exact single-digit answers (the demo's), enumerated
  deterministically, with a seeded train/eval partition so a demo can evaluate on prompts it never trained on.
* ``reasoning_gym`` -- procedural tasks of reasoning-gym (``grpo_producers.reasoning_gym_source``), each carrying
  the entry its dataset's ``score_answer`` needs; needs the ``reasoning-gym`` extra.

Prompt ids must be stable across runs and restarts: they are the feeder's resume key and, with epoch and sample
round, the group id every downstream role deduplicates by. Hence an explicit id field, or the SHA-1 of the
prompt text, never a line number (which shifts when a file is edited).
"""

from __future__ import annotations

import glob
import hashlib
import json
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from grpo_core.config import ConfigError, opt, require

Source = Literal["jsonl", "hf", "synthetic", "reasoning_gym"]
SyntheticTask = Literal["max", "min", "add_small", "last_digit", "copy", "copy_short", "reverse"]
# on_bad(reason, where): reason is a short label (a metric label value), where is e.g. "data.jsonl:17".
BadItemFn = Callable[[str, str], None]


@dataclass(frozen=True)
class DatasetItem:
    """One prompt of a dataset, before epochs and sample rounds turn it into PromptTasks."""

    prompt_id: str
    prompt: str
    task: str
    metadata: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------ configs


@dataclass
class RecordFields:
    """How a row (a JSON object, a dataset example) maps onto a DatasetItem: shared by ``jsonl`` and ``hf``."""

    prompt_field: str | None = opt(None, "Field holding the prompt text. Empty: 'question' if present, else 'prompt'.")
    answer_field: str | None = opt(
        "answer", "Field copied to metadata['answer'] for the verifier; rows without it are skipped. null: none.")
    id_field: str | None = opt(
        None, "Field holding a stable prompt id. Empty: '<name>-' + the first 12 hex digits of SHA-1(prompt).")
    task: str = opt("math", "Task name sent with every prompt: the reward the verifier applies (math, exact, ...).")
    metadata_fields: list[str] = opt(
        factory=list, help="Extra fields copied into the PromptTask metadata when present (scalars or flat lists).")


@dataclass
class JsonlConfig(RecordFields):
    """``source: jsonl``: one JSON object per line."""

    paths: list[str] = opt(factory=list, help="JSONL files or glob patterns, read in this order (globs sorted).")


@dataclass
class HfConfig(RecordFields):
    """``source: hf``: a local Hugging Face dataset (``save_to_disk`` dir, data dir or data file)."""

    path: str = opt("", "Local path: a save_to_disk directory, a directory of data files, or one data file.")
    split: str = opt("train", "Split to read.")


@dataclass
class SyntheticConfig:
    """``source: synthetic``: the demo's built-in tasks (task name ``exact``, answer in metadata)."""

    tasks: list[SyntheticTask] = opt(factory=lambda: ["max"], help="Task families mixed into the dataset.")
    split: Literal["train", "eval", "all"] = opt("train", "Which side of the held-out partition to feed.")
    eval_fraction: float = opt(0.2, "Share of each family's prompts held out for eval (seeded hash rank of the id).")
    seed: int = opt(0, "Partition/subset seed; the train and eval feeders must use the same one.")
    num_items: int = opt(0, "Keep this many items of the split (a seeded subset); 0: all.")

    def validate(self) -> None:
        require(bool(self.tasks), f"synthetic.tasks: pick at least one of {list(SYNTHETIC_TASKS)}")
        require(0.0 < self.eval_fraction < 1.0, "synthetic.eval_fraction: must be in (0, 1)")
        require(self.num_items >= 0, "synthetic.num_items: must be >= 0 (0: all)")


# ------------------------------------------------------------------------------------------ rows -> items


def stable_id(name: str, prompt: str) -> str:
    """The default prompt id: content-addressed, so it survives reordering and edits elsewhere in the file."""
    return f"{name}-{hashlib.sha1(prompt.encode('utf-8')).hexdigest()[:12]}"


def _wire_value(value: Any) -> Any:
    """``value`` if a PromptTask's metadata can carry it (scalar or flat list of scalars), else ValueError."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list | tuple) and all(v is None or isinstance(v, str | int | float | bool) for v in value):
        return list(value)
    raise ValueError(f"{type(value).__name__} is not a scalar or flat list")


def _answer(value: Any) -> str | list[str]:
    """Answers travel as text (a number is its decimal string; a list is several acceptable answers)."""
    value = _wire_value(value)
    if value is None:
        raise ValueError("null")
    return [str(v) for v in value] if isinstance(value, list) else str(value)


def item_from_row(row: Mapping[str, Any], fields: RecordFields, name: str, where: str,
                  on_bad: BadItemFn) -> DatasetItem | None:
    """Map one row to an item, or report why it cannot be one (``on_bad``) and return None."""
    key = fields.prompt_field or ("question" if "question" in row else "prompt")
    prompt = row.get(key)
    if not isinstance(prompt, str) or not prompt.strip():
        on_bad("missing_prompt", f"{where}: no non-empty string field {key!r}")
        return None
    metadata: dict[str, Any] = {}
    try:
        if fields.answer_field:
            if row.get(fields.answer_field) is None:
                on_bad("missing_answer", f"{where}: no field {fields.answer_field!r}")
                return None
            metadata["answer"] = _answer(row[fields.answer_field])
        for extra in fields.metadata_fields:
            if extra in row:
                metadata[extra] = _wire_value(row[extra])
    except ValueError as exc:
        on_bad("bad_metadata", f"{where}: {exc}")
        return None
    if fields.id_field:
        raw_id = row.get(fields.id_field)
        if raw_id is None or str(raw_id) == "":
            on_bad("missing_id", f"{where}: no field {fields.id_field!r}")
            return None
        prompt_id = str(raw_id)
    else:
        prompt_id = stable_id(name, prompt)
    return DatasetItem(prompt_id, prompt, fields.task, metadata)


# ------------------------------------------------------------------------------------------ jsonl


def _expand(patterns: list[str]) -> list[Path]:
    """Files in config order; a glob expands sorted. A missing file is a config error, not a bad line."""
    out: list[Path] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(Path(p) for p in glob.glob(pattern))
            if not matches:
                raise ConfigError(f"jsonl.paths: {pattern!r} matches no file")
            out.extend(matches)
        elif Path(pattern).is_file():
            out.append(Path(pattern))
        else:
            raise ConfigError(f"jsonl.paths: {pattern} does not exist")
    return out


def load_jsonl(cfg: JsonlConfig, name: str, on_bad: BadItemFn) -> Iterator[DatasetItem]:
    """Items of every line of every file; blank lines are ignored, bad ones reported and skipped.

    Lines are read as bytes and decoded one by one, so even invalid UTF-8 costs one line, not the file.
    """
    for path in _expand(cfg.paths):
        with path.open("rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                where = f"{path}:{lineno}"
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    on_bad("invalid_utf8", f"{where}: not UTF-8")
                    continue
                except json.JSONDecodeError as exc:
                    on_bad("invalid_json", f"{where}: {exc}")
                    continue
                if not isinstance(row, dict):
                    on_bad("not_an_object", f"{where}: a JSON {type(row).__name__}, expected an object")
                    continue
                item = item_from_row(row, cfg, name, where, on_bad)
                if item is not None:
                    yield item


# ------------------------------------------------------------------------------------------ hf


_HF_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


def _open_hf(cfg: HfConfig) -> Any:
    """The split as a ``datasets.Dataset`` from local files only (this project never downloads data)."""
    try:
        import datasets
    except ImportError:
        raise ConfigError("source hf: the `datasets` package is not installed: `pip install datasets` "
                          "(or export the data to JSONL and use source: jsonl)") from None
    path = Path(cfg.path)
    require(bool(cfg.path) and path.exists(), f"hf.path: {cfg.path!r} does not exist (only local datasets are read)")
    if path.is_dir() and any((path / f).exists() for f in ("dataset_info.json", "dataset_dict.json", "state.json")):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            require(cfg.split in ds, f"hf.split: {cfg.split!r} not in {sorted(ds)}")
            ds = ds[cfg.split]
        return ds
    if path.is_file():
        builder = _HF_FILE_BUILDERS.get(path.suffix.lower())
        require(builder is not None, f"hf.path: {path.suffix} files: use one of {sorted(_HF_FILE_BUILDERS)}")
        return datasets.load_dataset(builder, data_files={cfg.split: str(path)}, split=cfg.split)
    return datasets.load_dataset(str(path), split=cfg.split)


def load_hf(cfg: HfConfig, name: str, on_bad: BadItemFn) -> Iterator[DatasetItem]:
    """Items of a local HF dataset split, rows mapped exactly like JSONL objects."""
    ds = _open_hf(cfg)
    for i, row in enumerate(ds):
        item = item_from_row(row, cfg, name, f"{cfg.path}[{cfg.split}][{i}]", on_bad)
        if item is not None:
            yield item


# ------------------------------------------------------------------------------------------ synthetic

# Each family enumerates (key, prompt, answer). The first four have single-digit answers on purpose: a
# format-only warm start hits them by chance often enough (>= ~10%) for GRPO to get a learning signal on a tiny
# CPU model (measured: "a + b" over digits 0-9, 19 answers, stayed at chance for 3,000 steps).


def _max_task() -> Iterator[tuple[str, str, str]]:
    """max(a,b)= for digits a, b: 100 prompts. Uniform guessing scores 10%; always answering 9 scores 19%."""
    for a in range(10):
        for b in range(10):
            yield f"{a}-{b}", f"max({a},{b})=", str(max(a, b))


def _min_task() -> Iterator[tuple[str, str, str]]:
    """min(a,b)= for digits a, b: 100 prompts. Uniform guessing scores 10%; always answering 0 scores 19%."""
    for a in range(10):
        for b in range(10):
            yield f"{a}-{b}", f"min({a},{b})=", str(min(a, b))


def _add_small_task() -> Iterator[tuple[str, str, str]]:
    """a+b= for digits 0-4: 25 prompts, answers 0-8. Uniform digit guessing 10%; always 4 scores 20%."""
    for a in range(5):
        for b in range(5):
            yield f"{a}-{b}", f"{a}+{b}=", str(a + b)


def _last_digit_task() -> Iterator[tuple[str, str, str]]:
    """last(n)= for n in 10..999: the last digit, 990 prompts, answers uniform over 0-9 (chance 10%).

    The answer sits at a fixed distance before the answer position, so a 2-layer model can learn it by one
    attention pattern; it has no frequent answer to collapse onto, unlike max/min.
    """
    for n in range(10, 1000):
        yield str(n), f"last({n})=", str(n % 10)


def _digit_strings(per_length: int = 100, lengths: range = range(1, 9)) -> Iterator[str]:
    """Up to ``per_length`` distinct seeded digit strings of each length (all 10 of length 1, ...)."""
    rng = random.Random(1234)
    for n in lengths:
        seen: set[str] = set()
        while len(seen) < min(per_length, 10 ** n):
            seen.add("".join(rng.choice("0123456789") for _ in range(n)))
        yield from sorted(seen)


def _copy_task() -> Iterator[tuple[str, str, str]]:
    """copy(3847)= -> 3847 for 1-8 digits: multi-token answers (2-9 tokens with EOS, one token per digit), so
    sample lengths vary 4x+ (the long tail of ``bench async``). 710 prompts; reward ``positions`` (partial
    credit per digit in place)."""
    for digits in _digit_strings():
        yield digits, f"copy({digits})=", digits


def _copy_short_task() -> Iterator[tuple[str, str, str]]:
    """``copy`` for 1-4 digits (2-5 tokens with EOS; 310 prompts): the multi-token task the tiny model learns
    within a minute or two on 2 cores. On 1-8 digits it barely moves (the long answers are beyond its capacity
    from a format-only start), so the sweep and the async bench use this one."""
    for digits in _digit_strings(lengths=range(1, 5)):
        yield digits, f"copy({digits})=", digits


def _reverse_task() -> Iterator[tuple[str, str, str]]:
    """rev(3847)= -> 7483 for 1-8 digits, as ``copy`` but reversed (harder: no copy-the-next-digit shortcut)."""
    for digits in _digit_strings():
        yield digits, f"rev({digits})=", digits[::-1]


SYNTHETIC_TASKS: dict[str, Callable[[], Iterator[tuple[str, str, str]]]] = {
    "max": _max_task, "min": _min_task, "add_small": _add_small_task, "last_digit": _last_digit_task,
    "copy": _copy_task, "copy_short": _copy_short_task, "reverse": _reverse_task,
}
# The reward (the record's task) of each family; the rest are single-answer exact match.
SYNTHETIC_REWARDS: dict[str, str] = {"copy": "positions", "copy_short": "positions", "reverse": "positions"}


def _unit(seed: int, salt: str, key: str) -> float:
    """A deterministic uniform number in [0, 1) for ``key`` (stable across Python versions and processes)."""
    digest = hashlib.sha256(f"{seed}:{salt}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def synthetic_eval_ids(family: str, cfg: SyntheticConfig) -> set[str]:
    """The held-out prompt ids of one family: exactly round(eval_fraction * size) of them (at least one),
    chosen by seeded hash rank -- a per-item coin flip would leave small families (add_small: 25 prompts)
    with a handful or none."""
    ids = [f"syn-{family}-{key}" for key, _, _ in SYNTHETIC_TASKS[family]()]
    ranked = sorted(ids, key=lambda i: _unit(cfg.seed, "split", i))
    return set(ranked[:max(1, round(cfg.eval_fraction * len(ids)))])


def load_synthetic(cfg: SyntheticConfig, name: str, on_bad: BadItemFn) -> Iterator[DatasetItem]:
    """The chosen families' prompts on the chosen split, in a fixed order (the feeder shuffles per epoch).

    Ids (``syn-max-3-7``) do not depend on the feeder's name, so a train feeder and an eval feeder with the same
    ``synthetic.seed`` and ``eval_fraction`` agree on the partition. ``num_items`` keeps a seeded subset.
    """
    del name, on_bad  # generated items are never bad, and their ids are name-independent (see above)
    items = []
    for family in dict.fromkeys(cfg.tasks):
        held_out = synthetic_eval_ids(family, cfg)
        for key, prompt, answer in SYNTHETIC_TASKS[family]():
            prompt_id = f"syn-{family}-{key}"
            if cfg.split == "all" or (prompt_id in held_out) == (cfg.split == "eval"):
                items.append(DatasetItem(prompt_id, prompt, SYNTHETIC_REWARDS.get(family, "exact"),
                                         {"answer": answer, "family": family}))
    if cfg.num_items and cfg.num_items < len(items):
        keep = set(sorted(range(len(items)), key=lambda i: _unit(cfg.seed, "subset", items[i].prompt_id))
                   [:cfg.num_items])
        items = [it for i, it in enumerate(items) if i in keep]
    yield from items


# ------------------------------------------------------------------------------------------ the table


def load_reasoning_gym(cfg: Any, name: str, on_bad: BadItemFn) -> Iterator[DatasetItem]:
    """``source: reasoning_gym``; imported on use: that module builds on this one's DatasetItem."""
    from grpo_producers.reasoning_gym_source import load_reasoning_gym as load

    return load(cfg, name, on_bad)


Loader = Callable[[Any, str, BadItemFn], Iterator[DatasetItem]]
LOADERS: dict[str, Loader] = {"jsonl": load_jsonl, "hf": load_hf, "synthetic": load_synthetic,
                              "reasoning_gym": load_reasoning_gym}
