"""What the tokenizer scripts share: the repository root, their path options and their JSON files.

Imported by train_tokenizer.py, make_tokenizer_fixture.py and make_tokenizer_json_fixtures.py,
which find it beside them (a script's own directory is first on sys.path).
"""

import argparse
import json
import pathlib

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def argument_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by the first line of the script's docstring `doc`."""
    return argparse.ArgumentParser(description=doc.splitlines()[0])


def add_path_argument(
    parser: argparse.ArgumentParser, flag: str, default: str, help_text: str
) -> None:
    """A path option defaulting to `default`, a path relative to the repository root."""
    parser.add_argument(
        flag,
        type=pathlib.Path,
        default=REPO_ROOT / default,
        help=f"{help_text} (default: %(default)s)",
    )


def write_json(path: pathlib.Path, value, indent: int = 1) -> None:
    """`value` as UTF-8 JSON, characters unescaped, with a final newline; creates the directory.

    The bytes are the same on every platform: regenerating a committed file leaves it unchanged.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as out:
        json.dump(value, out, ensure_ascii=False, indent=indent)
        out.write("\n")
