"""Check an assembled GGUF file before converting it: whole, readable, and the model it should be."""

from __future__ import annotations

from pathlib import Path

from gguf import GGUFReader

from cascade.errors import CascadeError

MAGIC = b"GGUF"


def check_gguf(gguf: Path, architecture: str, tensors: int) -> int:
    """Fail with the reason unless ``gguf`` is a complete GGUF file of ``architecture`` listing
    ``tensors`` tensors; returns how many weights (tensor elements) it holds."""
    with gguf.open("rb") as handle:
        magic = handle.read(len(MAGIC))
    if magic != MAGIC:
        raise CascadeError(
            f"{gguf} is not a GGUF file: it starts with {magic!r}, not {MAGIC!r} "
            "(a part missing, damaged or out of order?)"
        )
    try:
        reader = GGUFReader(gguf)
    except (ValueError, IndexError) as exc:  # a tensor cut short fails numpy's view of it
        raise CascadeError(f"{gguf} is cut short or damaged: the gguf package cannot read it ({exc})") from None
    found = field_text(reader, "general.architecture")
    if found != architecture:
        raise CascadeError(f"{gguf} holds a {found!r} model, not the {architecture!r} model the catalog lists")
    if len(reader.tensors) != tensors:
        raise CascadeError(f"{gguf} lists {len(reader.tensors)} tensors, not the {tensors} of the catalog's model")
    return sum(int(tensor.n_elements) for tensor in reader.tensors)


def field_text(reader: GGUFReader, key: str) -> str | None:
    """A string field of the GGUF header (None if absent)."""
    field = reader.fields.get(key)
    return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
