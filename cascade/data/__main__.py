"""``python -m cascade.data {fetch,list}``: provision and list long documents under $CASCADE_HOME."""

from __future__ import annotations

import argparse
import sys

from cascade.data.corpus import CORPORA, DOCUMENTS, decode_text, document_path, fetch_corpus, is_fetched
from cascade.errors import CascadeError, entry_point


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cascade.data", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    fetch_cmd = commands.add_parser("fetch", help="download and extract corpora (default: all)")
    fetch_cmd.add_argument("corpora", nargs="*", metavar="CORPUS", help=f"any of: {', '.join(CORPORA)}")
    commands.add_parser("list", help="show documents, their paths, sizes and token counts")
    args = parser.parse_args(argv)
    if args.command == "fetch":
        for name in args.corpora or CORPORA:
            fetch_corpus(corpus_named(name))
    else:
        print_documents()
    return 0


def corpus_named(name: str):
    if name not in CORPORA:
        raise CascadeError(f"unknown corpus {name!r}; available corpora: {', '.join(CORPORA)}")
    return CORPORA[name]


def print_documents() -> None:
    count_tokens = token_counter()
    for name, corpus in DOCUMENTS.items():
        path = document_path(name)
        if not is_fetched(corpus):
            print(f"{name:12} {corpus.name:12} not fetched; run `python -m cascade.data fetch`")
            continue
        data = path.read_bytes()
        tokens = f"{count_tokens(decode_text(data, path)):>8} tokens" if count_tokens else ""
        print(f"{name:12} {corpus.name:12} {len(data):>9} bytes {tokens}  {path}")


def token_counter():
    """Counts tokens with the default target's tokenizer; None when that model is not installed."""
    from cascade.models import DEFAULTS, installed_path

    path = installed_path(DEFAULTS["target"])
    if path is None:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return lambda text: len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


if __name__ == "__main__":
    sys.exit(main())
