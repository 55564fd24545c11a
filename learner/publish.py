"""The learner's weights as a publishable stream: a safetensors file serialised straight from the state dict.

What ``save_pretrained`` would write (same tensor names, tied weights stored once, ``{"format": "pt"}``), but as a
:class:`~grpo_core.weights.Payload`: the header, then each tensor's bytes in place (no copy on CPU), so the weight
store writes or uploads it while hashing, with no temporary file and no read back. The file format
(https://huggingface.co/docs/safetensors): an 8-byte little-endian header length, a JSON header padded with
spaces to a multiple of 8, then the tensors' raw little-endian bytes back to back in the header's offsets.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import torch

from grpo_core.weights import Payload

if TYPE_CHECKING:
    from transformers import PretrainedConfig

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def unique_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each storage once: tied weights (e.g. ``lm_head.weight`` = ``embed_tokens.weight``)
    keep their first name, as ``save_pretrained`` does (vLLM's loader re-ties the head from the embedding)."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out = {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach()
    return out


def safetensors_payload(model: torch.nn.Module) -> Payload:
    """``model.safetensors`` of ``model``'s current weights, as a stream of blocks (read it once, right away:
    the blocks are views of the live parameters)."""
    return tensors_payload(unique_tensors(model))


def tensors_payload(tensors: dict[str, torch.Tensor]) -> Payload:
    """``model.safetensors`` of ``tensors`` (names as the model's state dict, each storage once)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} has no safetensors name")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text

    def blocks() -> Iterator[bytes | memoryview]:
        yield head
        for name in sorted(tensors):
            t = tensors[name].contiguous().cpu()  # a no-op for contiguous CPU tensors
            # numpy types ndarray as a Buffer on Python 3.12+ only (the ignore below)
            yield memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]

    return Payload(len(head) + offset, blocks)


def config_payload(model: torch.nn.Module) -> Payload:
    """``config.json`` as ``save_pretrained`` writes it."""
    return Payload.of_bytes(cast("PretrainedConfig", model.config).to_json_string(use_diff=True).encode())


def metadata_payloads(model: torch.nn.Module) -> dict[str, Payload]:
    """``config.json`` and, for a model that generates, ``generation_config.json``, as ``save_pretrained`` writes
    them. Made once per process and reused (payloads of bytes can be read any number of times): the model's
    configuration does not change while it trains, and rendering it costs ~7 ms per file, a sixth of a small
    model's publish."""
    files = {"config.json": config_payload(model)}
    gen = getattr(model, "generation_config", None)
    if gen is not None and getattr(model, "can_generate", lambda: False)():
        files["generation_config.json"] = Payload.of_bytes(gen.to_json_string(use_diff=True).encode())
    return files
