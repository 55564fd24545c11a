"""``source: reasoning_gym``: procedural, verifiable tasks from reasoning-gym (PyPI ``reasoning-gym``).

The items are reasoning-gym's own ``CompositeDataset`` over the configured datasets -- the object verl, SkyRL and
the ``verifiers`` environments train on -- so index ``i`` is the entry reasoning-gym itself generates for it:
``Random(seed + i)`` picks the dataset by weight, then that dataset's item ``i`` (each sub-dataset seeded with
``seed + its position + 1``). ``size`` items for the train split, ``eval_size`` for the held-out one.

**The held-out split** is disjoint twice over. By seed: reasoning-gym derives item ``i`` of a dataset from
``Random(dataset seed + i)``, so the train split's generator seeds lie in ``[seed, seed + size + n_datasets]``;
the held-out split is generated from ``seed + EVAL_SEED_OFFSET`` (10^9), a range the train split never reaches
(``size`` is capped below the offset). By content: a small problem space (leg counting with few animals) can
still draw the same question from two seeds, so the held-out feeder also generates the train split of the same
config (``seed``, ``size``, datasets) and drops every question the train split has (counted as ``in_train``).
Train and eval feeders therefore only need the same ``reasoning_gym`` section with a different ``split``.

**What the verifier gets** (PromptTask metadata, flat as the wire requires): ``answer`` (the oracle answer as
text, so ``exact``/``math`` can score it too), ``rg_dataset`` (the sub-dataset that generated the entry, from
``entry["metadata"]["source_dataset"]``), ``rg_config`` (that dataset's configured options as JSON: a few
``score_answer`` read ``self.config``, e.g. ``decimal_arithmetic``'s tolerance) and ``rg_entry`` (the whole entry
as JSON: ``score_answer(answer, entry)`` needs it, and it is nested). The reward that uses them is
``grpo_verifiers.rewards.reasoning_gym_reward``. An entry JSON cannot carry is skipped (``unencodable_entry``);
at start-up the first entries of every dataset are scored with their oracle answer before and after the JSON
round trip, and a dataset whose score changes is refused (its verdicts would be wrong, silently).

Prompt ids: ``<name>-<split><index>-<SHA-1(question)[:8]>``: stable across runs and processes (the generator is
seeded), and changed by a config that generates other questions, so the feeder refuses to resume a saved state of
another config instead of skipping or repeating prompts. An index whose generator raises is skipped
(``generation_error``); the first ones of every dataset are generated at start-up, where a failure is a
config error.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import string
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast

from grpo_core.config import ConfigError, opt, require
from grpo_producers.datasets import BadItemFn, DatasetItem

PACKAGE_HINT = "pip install 'grpo-stream[reasoning-gym]' (or reasoning-gym==0.1.25)"
EVAL_SEED_OFFSET = 1_000_000_000
MAX_SEED = 2**32 - 1  # numpy-seeded generators in reasoning-gym refuse larger seeds
USER_FIELDS = frozenset({"question", "dataset"})
_ROUNDTRIP_CHECKS = 3  # entries per dataset scored before and after the JSON round trip at start-up


@dataclass
class ReasoningGymDataset:
    """One dataset of the mix: its reasoning-gym name, its share and its options."""

    name: str = opt(help="A reasoning-gym dataset name (reasoning_gym.factory.DATASETS), e.g. basic_arithmetic.")
    weight: float = opt(1.0, "Relative share of the items drawn from this dataset.")
    config: dict[str, Any] = opt(
        factory=dict, help="The dataset's own options (its config dataclass, e.g. {min_animals: 2}); seed and size "
                           "come from the reasoning_gym section.")

    def validate(self) -> None:
        require(bool(self.name), "reasoning_gym.datasets[].name: must not be empty")
        require(self.weight > 0, f"reasoning_gym.datasets.{self.name}.weight: must be > 0, got {self.weight}")
        bad = sorted({"seed", "size"} & set(self.config))
        require(not bad, f"reasoning_gym.datasets.{self.name}.config: {bad} are set by reasoning_gym.seed/size "
                         "(and the held-out split), not per dataset")


@dataclass
class ReasoningGymConfig:
    """``source: reasoning_gym``: a seeded mix of reasoning-gym datasets with a held-out split."""

    datasets: list[str | ReasoningGymDataset] = opt(
        factory=lambda: ["basic_arithmetic"], help="Dataset names (equal weights), or {name, weight, config} "
        "entries; several make a reasoning-gym CompositeDataset.")
    size: int = opt(1000, "Items of the train split.")
    eval_size: int = opt(200, "Items generated for the held-out split (fewer are fed when questions repeat the "
                              "train split's: those are dropped).")
    seed: int = opt(0, "Generator seed; the train and held-out feeders must use the same one (and size).")
    split: Literal["train", "eval"] = opt("train", "train, or eval: the held-out split (another seed range, minus "
                                                   "any question of the train split).")
    system: str = opt("default", "Instruction put before the question: a reasoning-gym preset (default, "
                                 "DeepSeekZero, simple, direct, chain_of_draft) or the text itself; empty: none. The "
                                 "producers send one user message, so it leads that message.")
    user: str = opt("{question}", "The question's template; placeholders {question} and {dataset}.")
    task: str = opt("reasoning_gym", "Task name sent with every prompt: the verifier's reasoning_gym reward scores "
                                     "it with the generating dataset's score_answer.")

    def specs(self) -> list[ReasoningGymDataset]:
        """The datasets as entries (a bare name is weight 1, default options)."""
        return [d if isinstance(d, ReasoningGymDataset) else ReasoningGymDataset(d) for d in self.datasets]

    def validate(self) -> None:
        """Checks that need no reasoning-gym (this runs whatever the source); :func:`check` does the rest."""
        specs = self.specs()
        require(bool(specs), "reasoning_gym.datasets: list at least one dataset, e.g. [basic_arithmetic]")
        for spec in specs:
            spec.validate()
        names = [s.name for s in specs]
        require(len(set(names)) == len(names), f"reasoning_gym.datasets: {names} names a dataset twice")
        require(1 <= self.size < EVAL_SEED_OFFSET // 2, f"reasoning_gym.size: must be in [1, {EVAL_SEED_OFFSET // 2})")
        require(1 <= self.eval_size < EVAL_SEED_OFFSET // 2,
                f"reasoning_gym.eval_size: must be in [1, {EVAL_SEED_OFFSET // 2})")
        require(self.seed >= 0 and self.seed + EVAL_SEED_OFFSET + self.eval_size + len(specs) <= MAX_SEED,
                f"reasoning_gym.seed: must be in [0, {MAX_SEED - EVAL_SEED_OFFSET - self.eval_size - len(specs)}]")
        fields = {f for _, f, _, _ in string.Formatter().parse(self.user) if f is not None}
        require("question" in fields, "reasoning_gym.user: must contain {question}")
        require(fields <= USER_FIELDS, f"reasoning_gym.user: unknown placeholders {sorted(fields - USER_FIELDS)}; "
                                       f"allowed: {sorted(USER_FIELDS)} (write {{{{ and }}}} for literal braces)")


# ------------------------------------------------------------------------------------------ start-up checks


def _rg() -> Any:
    """The reasoning_gym package, or a ConfigError saying how to install it."""
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(f"source reasoning_gym: the reasoning-gym package is not installed: {PACKAGE_HINT}") from None
    return reasoning_gym


def _check_spec(spec: ReasoningGymDataset, where: str) -> None:
    """The name is registered and the options build and validate its config dataclass."""
    from reasoning_gym.factory import DATASETS

    require(spec.name != "composite", f"{where}.name: list the datasets of a composite here, with their weights")
    if spec.name not in DATASETS:
        known = [n for n in DATASETS if n != "composite"]
        close = difflib.get_close_matches(spec.name, known, n=3, cutoff=0.5)
        hint = (f"did you mean {' or '.join(map(repr, close))}?" if close
                else f"choose one of the {len(known)} in reasoning_gym.factory.DATASETS")
        raise ConfigError(f"{where}.name: unknown reasoning-gym dataset {spec.name!r}; {hint}")
    _, config_cls = DATASETS[spec.name]
    fields = {f.name for f in dataclasses.fields(config_cls)} - {"seed", "size"}
    for key in spec.config:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            raise ConfigError(f"{where}.config.{key}: not an option of {spec.name}"
                              + (f"; did you mean {close[0]!r}?" if close else f"; options: {sorted(fields)}"))
    try:
        config = config_cls(**spec.config)
        if hasattr(config, "validate"):
            config.validate()
    except (AssertionError, ValueError, TypeError) as exc:
        raise ConfigError(f"{where}.config: {spec.name} refuses {spec.config}: {exc or type(exc).__name__}") from None


def check(cfg: ReasoningGymConfig) -> None:
    """Start-up checks with the package: installed, names known (close matches offered), options valid, and every
    dataset's first entries generate and score the same after the JSON round trip the metadata makes."""
    _rg()
    specs = cfg.specs()
    for i, spec in enumerate(specs):
        _check_spec(spec, f"reasoning_gym.datasets[{i}]")
    composite = build(cfg, "train")
    checked: dict[str, int] = {}
    for index in range(min(cfg.size, 50 * len(specs))):
        try:
            entry = composite[index]
        except Exception as exc:  # any generator bug is this config's problem: say which dataset, now
            raise ConfigError(f"reasoning_gym.datasets: generating item {index} failed: {type(exc).__name__}: "
                              f"{exc}; check the datasets' options") from None
        name = source_of(entry, specs)
        if name is None or checked.get(name, 0) >= _ROUNDTRIP_CHECKS:
            continue
        checked[name] = checked.get(name, 0) + 1
        _check_roundtrip(composite.datasets[name], entry, name)
        if sum(checked.values()) == _ROUNDTRIP_CHECKS * len(specs):
            return


def _check_roundtrip(dataset: Any, entry: dict[str, Any], name: str) -> None:
    try:
        text = json.dumps(entry, allow_nan=False)
    except (TypeError, ValueError):
        return  # counted per item at load time (unencodable_entry)
    answer = entry.get("answer")
    if not isinstance(answer, str):
        return  # no single oracle answer to check with
    before, after = dataset.score_answer(answer, entry), dataset.score_answer(answer, json.loads(text))
    require(before == after, f"reasoning_gym.datasets: {name}'s entries do not survive JSON (the oracle answer "
                             f"scores {before} on the entry, {after} on its JSON copy); this dataset cannot be "
                             "scored from PromptTask metadata")


# ------------------------------------------------------------------------------------------ items


def build(cfg: ReasoningGymConfig, split: str) -> Any:
    """reasoning-gym's CompositeDataset of ``split`` (see the module docstring for the seed ranges)."""
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    eval_split = split == "eval"
    config = CompositeConfig(
        size=cfg.eval_size if eval_split else cfg.size, seed=cfg.seed + (EVAL_SEED_OFFSET if eval_split else 0),
        datasets=[DatasetSpec(s.name, s.weight, dict(s.config)) for s in cfg.specs()])
    return CompositeDataset(config)


def source_of(entry: dict[str, Any], specs: list[ReasoningGymDataset]) -> str | None:
    """The sub-dataset that generated ``entry`` (what the composite's own score_answer looks up)."""
    meta = entry.get("metadata")
    name = meta.get("source_dataset") if isinstance(meta, dict) else None
    if name is None and len(specs) == 1:
        return specs[0].name
    return name if any(s.name == name for s in specs) else None


def system_text(system: str) -> str:
    """A preset's text (reasoning-gym's SYSTEM_PROMPTS; ``default`` asks for ``<answer>...</answer>``, the
    convention its score_answer functions are written for), else ``system`` itself."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return cast(str, SYSTEM_PROMPTS.get(system, system)).strip()


def _item(cfg: ReasoningGymConfig, entry: dict[str, Any], index: int, name: str, dataset: str,
          context: tuple[str, dict[str, str]], on_bad: BadItemFn) -> DatasetItem | None:
    """One entry as an item; ``context``: the system text and each dataset's options as JSON."""
    system, options = context
    where = f"reasoning_gym[{cfg.split}][{index}] ({dataset})"
    question = entry.get("question")
    if not isinstance(question, str) or not question.strip():
        on_bad("missing_prompt", f"{where}: no question")
        return None
    try:
        entry_json = json.dumps(entry, allow_nan=False)
    except (TypeError, ValueError) as exc:
        on_bad("unencodable_entry", f"{where}: the entry is not JSON: {exc}")
        return None
    user = cfg.user.format(question=question, dataset=dataset)
    metadata: dict[str, Any] = {"rg_dataset": dataset, "rg_config": options[dataset], "rg_entry": entry_json}
    if entry.get("answer") is not None:
        metadata["answer"] = str(entry["answer"])
    digest = hashlib.sha1(question.encode("utf-8")).hexdigest()[:8]
    return DatasetItem(f"{name}-{cfg.split}{index}-{digest}", f"{system}\n\n{user}" if system else user, cfg.task,
                       metadata)


def _train_questions(cfg: ReasoningGymConfig) -> set[str]:
    """Every question of the train split (what the held-out split must not ask)."""
    train, questions = build(cfg, "train"), set()
    for index in range(cfg.size):
        try:
            questions.add(train[index]["question"])
        except Exception:  # an item the train feeder skips (generation_error) asks nothing
            continue
    return questions


def load_reasoning_gym(cfg: ReasoningGymConfig, name: str, on_bad: BadItemFn) -> Iterator[DatasetItem]:
    """The split's items in index order (the feeder shuffles per epoch)."""
    _rg()
    specs = cfg.specs()
    context = (system_text(cfg.system) if cfg.system else "", {s.name: json.dumps(s.config, sort_keys=True)
                                                                for s in specs})
    composite = build(cfg, cfg.split)
    seen_in_train = _train_questions(cfg) if cfg.split == "eval" else set()
    for index in range(len(composite)):
        try:
            entry = composite[index]
        except Exception as exc:  # a generator bug at one seed costs that item, not the feed
            on_bad("generation_error", f"reasoning_gym[{cfg.split}][{index}]: {type(exc).__name__}: {exc}")
            continue
        dataset = source_of(entry, specs)
        if dataset is None:
            on_bad("no_source_dataset", f"reasoning_gym[{cfg.split}][{index}]: entry metadata names no configured "
                                        "source_dataset")
        elif entry.get("question") in seen_in_train:
            on_bad("in_train", f"reasoning_gym[eval][{index}] ({dataset}): the train split has this question")
        else:
            item = _item(cfg, entry, index, name, dataset, context, on_bad)
            if item is not None:
                yield item
