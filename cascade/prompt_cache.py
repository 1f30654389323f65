"""Prefilled prompts on disk: a full-cache stage that has prefilled the same prompt before, with the
same model and settings, loads the prompt's K/V and last logits instead of recomputing them.

One safetensors file per (model, settings, prompt): each layer's keys and values [1, H_kv, T, D],
the last position's logits [V] and the prompt's token ids (checked on load). The file's name
hashes everything that decides those numbers: the checkpoint's files, dtype, rope scaling,
device type, prefill chunk, the fused-pass setting, the attention kernel family and the
model code itself, so a loaded prompt is what prefilling it would compute. Files are written to a
temporary name and renamed (an interrupted write leaves nothing behind); after each write the least
recently used files beyond ``max_gb`` are deleted (only files named as this cache names them: the
directory may hold anything else); a file that cannot be read is reported, deleted and recomputed.
A directory that cannot be written is reported and the prompt computed as without a cache.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from cache import full, slots
from cache.full import FullCache
from cascade import atomic, attention, checkpoint, fused, model, rope

logger = logging.getLogger(__name__)

MODEL_CODE = (model, attention, rope, fused, checkpoint, full, slots)
"""Modules whose source decides a prefill's numbers: editing them invalidates stored prompts."""


STORED_NAME = re.compile(r"[0-9a-f]{64}\.safetensors")
"""A stored prompt's file name: the digest of ``PromptCache.path``. Eviction touches nothing else."""

KV_NAMES = ("keys", "values")
"""A stored layer's tensors are named ``keys.{layer}`` and ``values.{layer}``."""


def stored_layer(stored: safe_open, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From an open prompt file: ``layer``'s keys and values [1, H_kv, length, D] (rotated keys)
    of the prompt's first ``length`` tokens."""
    keys, values = (stored.get_slice(f"{name}.{layer}")[:, :, :length] for name in KV_NAMES)
    return keys, values


def model_key(checkpoint_dir: Path, settings: dict[str, object]) -> str:
    """Digest of a checkpoint's files (name, size, mtime), ``settings`` and the model code."""
    digest = hashlib.sha256()
    for path in sorted(checkpoint_dir.iterdir()):
        if path.is_file():
            status = path.stat()
            digest.update(f"{path.name}:{status.st_size}:{status.st_mtime_ns};".encode())
    digest.update(repr(sorted(settings.items())).encode())
    for module in MODEL_CODE:
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class PromptCache:
    """One model's stored prefills in ``directory``; ``model`` is that model's ``model_key``."""

    directory: Path
    model: str
    max_bytes: int

    def path(self, prompt_ids: torch.Tensor, chunk: int) -> Path:
        digest = hashlib.sha256(f"{self.model}:{chunk}:".encode())
        digest.update(prompt_ids.cpu().to(torch.int64).numpy().tobytes())
        return self.directory / f"{digest.hexdigest()}.safetensors"

    def load(self, prompt_ids: torch.Tensor, chunk: int, cache: FullCache) -> torch.Tensor | None:
        """Fill ``cache`` with the stored prefill of prompt_ids [T] -> its last logits [V], or None."""
        path = self.path(prompt_ids, chunk)
        if not path.exists():
            return None
        length = prompt_ids.numel()
        try:
            with safe_open(path, framework="pt", device=str(cache.layout.device)) as stored:
                if not torch.equal(stored.get_tensor("prompt").cpu(), prompt_ids.cpu().to(torch.int64)):
                    raise ValueError("it holds a different prompt")
                cache.allocate(length)
                for layer in range(cache.layout.num_layers):
                    keys, values = stored_layer(stored, layer, length)
                    cache.keys[layer, :, :, :length], cache.values[layer, :, :, :length] = keys, values
                logits = stored.get_tensor("logits")  # [V]
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            logger.warning(f"prompt cache: {path.name} is unusable ({exc}); deleting it and prefilling")
            cache.rollback(0)
            path.unlink(missing_ok=True)
            return None
        cache.commit(length)
        os.utime(path)  # most recently used
        return logits

    def save(self, prompt_ids: torch.Tensor, chunk: int, cache: FullCache, logits: torch.Tensor) -> None:
        """Store the prefill of prompt_ids [T] (now in ``cache``) and its last logits [V]."""
        length = prompt_ids.numel()
        tensors = {"prompt": prompt_ids.cpu().to(torch.int64), "logits": logits.contiguous()}
        for layer in range(cache.layout.num_layers):
            for name, buffer in zip(KV_NAMES, (cache.keys, cache.values), strict=True):
                tensors[f"{name}.{layer}"] = buffer[layer, :, :, :length].contiguous()  # [1, H_kv, T, D]
        path = self.path(prompt_ids, chunk)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with atomic.replacing(path) as partial:
                save_file(tensors, partial)
        except OSError as exc:
            logger.warning(f"prompt cache: could not store {path.name} in {self.directory}: {exc.strerror or exc}")
            return
        self._evict(keep=path)

    def _evict(self, keep: Path) -> None:
        """Delete the least recently used stored prompts until the rest fit in ``max_bytes``."""
        stored = [path for path in self.directory.iterdir() if STORED_NAME.fullmatch(path.name)]
        stored.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        total = 0
        for path in stored:
            total += path.stat().st_size
            if total > self.max_bytes and path != keep:
                path.unlink(missing_ok=True)
