"""Prefilled prompts on disk: a stage whose cache holds its prompt whole (a full cache, or a
streaming one while the prompt fits before its first eviction: ``holds_every_prompt_token``) and
whose prompt begins with one prefilled before, with the same model and settings, loads that
prefix's K/V instead of recomputing it, and the last logits too when the whole prompt was
prefilled before.

A prompt's prefill is stored as it ran: one file per ``chunk``-token pass (each layer's keys and
values [1, H_kv, chunk, D] and the pass's token ids, checked on load), the last pass's file holding
the last position's logits [V] and queries [L, H, D] too (``SlotCache.last_queries``). A pass's file
is named by a digest of every token up to its end (the last pass's by the whole prompt, tagged
apart) and of everything that decides those numbers:
the checkpoint's files, dtype, rope scaling, device type, the chunk, the fused-pass setting, the
attention kernel family and the model code itself. A new prompt that shares its first N tokens
with a stored one finds the files of the passes within them, loads them, and prefills the rest
from there, pass for pass as a cold prefill would (the passes start at multiples of ``chunk``):
its K/V and logits are bitwise a cold run's. Prompts sharing a prefix share its files.

Files are written to a temporary name and renamed (an interrupted write leaves nothing behind; two
processes writing the same file write the same bytes); after each write the least recently used
files beyond ``max_gb`` are deleted (only files named as this cache names them: the directory may
hold anything else); a file that cannot be read is reported, deleted and recomputed. A directory
that cannot be written is reported and the prompt computed as without a cache.
"""

from __future__ import annotations

import contextlib
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
from cache.slots import SlotCache
from cascade import atomic, attention, checkpoint, fused, model, rope

logger = logging.getLogger(__name__)

MODEL_CODE = (model, attention, rope, fused, checkpoint, full, slots)
"""Modules whose source decides a prefill's numbers: editing them invalidates stored prompts."""


STORED_NAME = re.compile(r"[0-9a-f]{64}\.safetensors")
"""A stored prompt's file name: the digest of ``PromptCache.path``. Eviction touches nothing else."""

KV_NAMES = ("keys", "values")
"""A stored layer's tensors are named ``keys.{layer}`` and ``values.{layer}``."""


def stored_layer(stored: safe_open, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From an open file of a stored pass: ``layer``'s keys and values [1, H_kv, N, D] (rotated keys)."""
    keys, values = (stored.get_tensor(f"{name}.{layer}") for name in KV_NAMES)
    return keys, values


def touch(path: Path) -> bool:
    """Mark ``path`` most recently used; False if it does not exist (or no longer: another process
    may evict it)."""
    try:
        os.utime(path)
    except FileNotFoundError:
        return False
    return True


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

    def passes(self, prompt_ids: torch.Tensor, chunk: int) -> list[tuple[Path, range]]:
        """The files of prompt_ids' [T] prefill with the positions of each: one per pass of
        ``chunk`` tokens before the last, then the last pass's (which holds the logits)."""
        tokens = prompt_ids.cpu().to(torch.int64).numpy()
        last_pass = (len(tokens) - 1) // chunk * chunk
        digest = hashlib.sha256(f"{self.model}:{chunk}:".encode())
        files = []
        for start in range(0, len(tokens), chunk):
            span = range(start, min(start + chunk, len(tokens)))
            digest.update(tokens[span.start : span.stop].tobytes())
            name = digest.copy()
            name.update(b"prompt" if start == last_pass else b"prefix")
            files.append((self.directory / f"{name.hexdigest()}.safetensors", span))
        return files

    def path(self, prompt_ids: torch.Tensor, chunk: int) -> Path:
        """The file that completes prompt_ids' stored prefill: its last pass's, with the logits."""
        return self.passes(prompt_ids, chunk)[-1][0]

    def load(self, prompt_ids: torch.Tensor, chunk: int, cache: SlotCache) -> tuple[int, torch.Tensor | None]:
        """Fill the emptied ``cache`` with the longest stored prefix of prompt_ids [T], whole passes
        from the start -> (its length, the last logits [V] if it is the whole prompt, else None)."""
        logits = None
        for path, span in self.passes(prompt_ids, chunk):
            if not path.exists():
                break
            try:
                logits = self._load_pass(path, prompt_ids[span.start : span.stop], cache)
            except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
                logger.warning(f"prompt cache: {path.name} is unusable ({exc}); deleting it and prefilling")
                cache.rollback(span.start)
                path.unlink(missing_ok=True)
                break
            cache.commit(span.stop)
            touch(path)
        return cache.length, logits

    def _load_pass(self, path: Path, pass_ids: torch.Tensor, cache: SlotCache) -> torch.Tensor | None:
        """Append one stored pass of pass_ids [N] to ``cache`` -> its logits [V] if it has them."""
        with safe_open(path, framework="pt", device=str(cache.layout.device)) as stored:
            if not torch.equal(stored.get_tensor("prompt").cpu(), pass_ids.cpu().to(torch.int64)):
                raise ValueError("it holds other tokens")
            start, end = cache.length, cache.length + pass_ids.numel()
            cache.allocate(pass_ids.numel())
            for layer in range(cache.layout.num_layers):
                keys, values = stored_layer(stored, layer)
                cache.keys[layer, :, :, start:end], cache.values[layer, :, :, start:end] = keys, values
            if "last_queries" in stored.keys():
                cache.hold_last_queries(stored.get_tensor("last_queries"))  # [L, H, D]
            return stored.get_tensor("logits") if "logits" in stored.keys() else None  # [V]

    def save(self, prompt_ids: torch.Tensor, chunk: int, cache: SlotCache, logits: torch.Tensor) -> None:
        """Store the passes of prompt_ids' [T] prefill (now in ``cache``) not stored yet, the last
        with its logits [V]."""
        passes = self.passes(prompt_ids, chunk)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            for index, (path, span) in enumerate(passes):
                if touch(path):
                    continue
                last = index == len(passes) - 1
                tensors = self._pass_tensors(prompt_ids, span, cache, logits if last else None)
                with atomic.replacing(path) as partial:
                    save_file(tensors, partial)
        except OSError as exc:
            logger.warning(f"prompt cache: could not store a prefill in {self.directory}: {exc.strerror or exc}")
            return
        self._evict(keep={path for path, _ in passes})

    @staticmethod
    def _pass_tensors(
        prompt_ids: torch.Tensor, span: range, cache: SlotCache, logits: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        tensors = {"prompt": prompt_ids[span.start : span.stop].cpu().to(torch.int64)}
        if logits is not None:
            tensors["logits"] = logits.contiguous()
        if cache.last_queries_at == span.stop - 1:
            tensors["last_queries"] = cache.last_queries.contiguous()  # [L, H, D]
        for layer in range(cache.layout.num_layers):
            for name, buffer in zip(KV_NAMES, (cache.keys, cache.values), strict=True):
                tensors[f"{name}.{layer}"] = buffer[layer, :, :, span.start : span.stop].contiguous()  # [1, H_kv, N, D]
        return tensors

    def _evict(self, keep: set[Path]) -> None:
        """Delete the least recently used stored passes until the rest fit in ``max_bytes`` (files
        another process deletes meanwhile are passed over)."""
        stored = []
        for path in self.directory.iterdir():
            if STORED_NAME.fullmatch(path.name):
                with contextlib.suppress(FileNotFoundError):
                    status = path.stat()
                    stored.append((status.st_mtime, status.st_size, path))
        total = 0
        for _, size, path in sorted(stored, key=lambda entry: entry[0], reverse=True):
            total += size
            if total > self.max_bytes and path not in keep:
                path.unlink(missing_ok=True)
