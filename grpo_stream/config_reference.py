"""The configuration reference page, ``docs/configuration.md``, generated from the typed configs: every key with
its default and the ``opt(help=...)`` text it is declared with. ``grpo-stream config reference`` writes it;
``--check`` exits 1 when the page differs from what the code declares (``ops/test.sh`` runs it), so the page
cannot drift from the code."""

from __future__ import annotations

from pathlib import Path

from grpo_core.config import explain_rows
from grpo_stream.roles import import_class

PAGE = Path("docs/configuration.md")
# (title, config class, what it configures); the kafka and pipeline keys every role shares are listed once.
SECTIONS: list[tuple[str, str, str]] = [
    ("The pipeline contract", "grpo_core.contract:PipelineContract",
     "Settings every role must agree on: the `pipeline:` section of a role's YAML or `--pipeline "
     "configs/pipeline.yaml`, under `pipeline.` in every role's config."),
    ("Kafka connection", "grpo_core.config:KafkaConfig",
     "How each process reaches the cluster: the `kafka:` section of every role's config."),
    ("Feeder", "grpo_producers.feeder_config:FeederConfig", "`grpo-stream feeder` (`configs/feeder.yaml`)."),
    ("Producer", "grpo_producers.config:ProducerConfig", "`grpo-stream producer` (`configs/producer.yaml`)."),
    ("Verifier", "grpo_verifiers.config:VerifierConfig", "`grpo-stream verifier` (`configs/verifier.yaml`)."),
    ("Learner", "grpo_learner.config:LearnerConfig", "`grpo-stream learner` (`configs/learner.yaml`)."),
    ("Run", "grpo_stream.run:RunConfig",
     "`grpo-stream run` / `demo`: one YAML for a whole local pipeline; its `feeder:`, `learner:` and "
     "`producers.config` / `verifiers.config` sections take the role keys above."),
]
SHARED = ("pipeline.", "kafka.")


def _cell(text: str, code: bool = False) -> str:
    """A table cell: pipes escaped; outside code, ``<`` too (``<run>`` would be read as an HTML tag)."""
    text = text.replace("|", "\\|").replace("\n", " ")
    return f"`{text}`" if code else text.replace("<", "&lt;")


def render() -> str:
    """The whole page."""
    out = ["# Configuration reference", "",
           "Every key of every process's config, its default and what it does, generated from the typed configs "
           "(`grpo-stream config reference`; the same text as `grpo-stream config explain <role>`). Set a key in "
           "the role's YAML or as a `key=value` override on the command line. How configs are loaded and "
           "validated: [code layout](layout.md).", ""]
    for title, path, what in SECTIONS:
        prefix = {"PipelineContract": "pipeline.", "KafkaConfig": "kafka."}.get(path.split(":")[1], "")
        out += [f"## {title}", "", what, "", "| key | default | what it does |", "|---|---|---|"]
        for key, default, text in explain_rows(import_class(path), prefix):
            if not prefix and key.startswith(SHARED):
                continue
            out.append(f"| {_cell(key, code=True)} | {_cell(default, code=True)} | {_cell(text)} |")
        out.append("")
    return "\n".join(out)


def main(check: bool, page: Path = PAGE) -> int:
    """Write the page, or with ``check`` compare it; 1 and one line when it is stale."""
    text = render()
    if not check:
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(text)
        print(f"wrote {page}")
        return 0
    if not page.is_file() or page.read_text() != text:
        print(f"{page} is stale: the typed configs changed; run `grpo-stream config reference` and commit it")
        return 1
    print(f"{page} is up to date")
    return 0
