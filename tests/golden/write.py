"""Write the golden wire records of the current schema major: ``python tests/golden/write.py``.

One record of every type, plus the first release's ``scored_group`` (none of the fields added since), under
``tests/golden/wire-v<major>/``. A file that exists is never rewritten -- these are the bytes older code wrote,
which every later reader must still decode (``tests/test_golden.py``). Run it once per major: after a bump, and
when a record type is added (the test asks for it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from grpo_core import wire  # noqa: E402

G = 4


def _completion(i: int, spans: bool) -> wire.Completion:
    rng = np.random.default_rng(i)
    n = 6 + 2 * i  # lengths vary, as a batch's do
    extra = {"later_versions": [8], "later_starts": [3], "logprob_temperature": 1.0} if spans and i == 1 else {}
    return wire.Completion(
        group_id="copy-17@e0r0", index=i, group_size=G, prompt_id="copy-17", task="copy",
        prompt_token_ids=np.array([40, 41, 42, 43, 44], dtype=np.int32),
        completion_token_ids=rng.integers(3, 300, n).astype(np.int32),
        behaviour_logprobs=-rng.uniform(0.1, 6.0, n).astype(np.float32), policy_version=7,
        producer_id="producer-0", finish_reason="stop" if i % 2 else "length", prompt="copy(17)=",
        completion="17", epoch=0, metadata={"answer": "17", "attempt": "a1b2c3d4e5f6"},
        timings={"generate_s": 0.25}, **extra)


def _group(spans: bool) -> wire.ScoredGroup:
    rewards = [0.0, 0.5, 1.0, 0.25]
    return wire.ScoredGroup(
        group_id="copy-17@e0r0", prompt_id="copy-17", task="copy", policy_version=7,
        completions=[_completion(i, spans) for i in range(G)], rewards=rewards,
        reward_mean=float(np.mean(rewards)), reward_std=float(np.std(rewards)), verifier_id="verifier-0",
        group_size=G, reward_info={"kind": "positions"}, scored_at=1_780_000_000.0)


def records() -> dict[str, wire.Record]:
    """File stem -> record: every type of the current major, and the first release's scored group."""
    return {
        "prompt": wire.PromptTask(prompt_id="copy-17", prompt="copy(17)=", task="copy", epoch=1, sample_round=0,
                                  metadata={"answer": "17"}),
        "completion": _completion(1, spans=True),
        "scored_group": _group(spans=True),
        "scored_group-first-release": _group(spans=False),
        "weights": wire.WeightsAnnouncement(run="demo", version=7, store="fs", location="demo/v00000007",
                                            sha256="ab" * 32, size_bytes=1_400_000),
        "weight_chunk": wire.WeightChunk(run="demo", version=7, index=0, num_chunks=1, data=b"\x00\x01\x02"),
        "dead_letter": wire.DeadLetter(source_topic="demo.groups", partition=0, offset=7, reason="not msgpack",
                                       raw=b"\xc1", key=b"k"),
    }


def main() -> int:
    out = HERE / f"wire-v{wire.SCHEMA_VERSION}"
    out.mkdir(exist_ok=True)
    for stem, record in records().items():
        path = out / f"{stem}.msgpack"
        if path.exists():
            print(f"kept    {path.relative_to(HERE)} (golden files are never rewritten)")
            continue
        path.write_bytes(wire.encode(record))
        print(f"wrote   {path.relative_to(HERE)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
