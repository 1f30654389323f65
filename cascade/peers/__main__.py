"""``python -m cascade.peers build``: build llama.cpp's tools and convert a checkpoint to GGUF, once.

Everything goes under ``$CASCADE_HOME/peers/``; a second run finds it and does nothing.
``scripts/bench.py --impls ... llama.cpp llama.cpp-q8_0`` does the same before its rounds.
"""

from __future__ import annotations

import argparse
import sys

from cascade.checkpoint import checkpoint_option
from cascade.errors import entry_point
from cascade.models import default_model
from cascade.peers.convert import GGUF_TYPES, ensure_gguf
from cascade.peers.llamacpp import ensure_built


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cascade.peers", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build llama.cpp (about 10 min on 2 cores) and convert the target")
    build.add_argument(
        "--target", type=checkpoint_option, help="checkpoint directory (default: the provisioned SmolLM2)"
    )
    build.add_argument("--types", nargs="+", choices=GGUF_TYPES, default=list(GGUF_TYPES), help="GGUF types to write")
    args = parser.parse_args(argv)
    target = args.target or default_model("target")
    llama = ensure_built()
    print(f"llama.cpp {llama.commit} (vendored by llama-cpp-python {llama.llama_cpp_python}): {llama.root}")
    for outtype in args.types:
        print(f"{outtype}: {ensure_gguf(llama, target, outtype)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
