"""Writes tests/fixtures/tokenizer_cases.json: reference encodings of the bundled tokenizer.

Each case is {"text": ..., "ids": [...], "decoded": ...} as produced by HF `tokenizers` (the
version pinned in tools/requirements.txt) from configs/tokenizer/vocab.json and merges.txt, with
no special tokens added. The C++ tokenizer must reproduce `ids` and `decoded` exactly. The
strings stress the pre-tokenisation pattern (whitespace runs, contractions, Unicode categories)
and byte-level BPE (multi-byte characters that no merge covers).

Usage:
    python tools/make_tokenizer_fixture.py [--tokenizer-dir DIR] [--out PATH]
"""

import argparse
import pathlib
import sys

from tokenizers import ByteLevelBPETokenizer

from tokenizer_common import add_path_argument, argument_parser, write_json

CASES = [
    # Whitespace.
    "",
    " ",
    "  ",
    "     ",
    " hello",
    "hello ",
    "  hello  world  ",
    "\t",
    "tab\tseparated\tvalues",
    "line one\nline two",
    "windows\r\nline endings\r\n",
    "paragraph one.\n\n\nparagraph two.",
    "\n",
    " \n \t x",
    "indented\n    code block\n\tand a tab",
    "trailing newline\n",
    # Contractions, including forms the pattern does not treat as contractions.
    "it's don't we're they've I'm we'll he'd",
    "IT'S DON'T WE'RE",
    "the dog's bone and the cats' toys",
    "'s 't 're 've 'm 'll 'd",
    "rock 'n' roll, o'clock, y'all",
    "curly apostrophe: don\u2019t",
    # Numbers and punctuation.
    "0",
    "12345678901234567890",
    "3.14159, 2.71828 and 1,000,000.",
    "On 20 July 1969 at 20:17 UTC.",
    "Prices: $4.99, \u00a33, \u20ac10, 50%!",
    "!!! ??? ... --- ***",
    "(a) [b] {c} <d> \"e\" 'f' `g`",
    "user@example.com #hashtag @mention",
    "https://www.example.com/path/to/page.html?id=42&lang=en#top",
    "for (int n = 1; n <= 10; ++n) printf(\"%d\\n\", n * n);",
    "def f(x):\n    return x ** 2  # square\n",
    "<s>not a special token</s> <pad> <unk>",
    # Latin script beyond ASCII.
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 fa\u00e7ade",
    "Stra\u00dfe gro\u00df Fu\u00dfball",
    "\u00c5ngstr\u00f6m \u0141\u00f3d\u017a \u0160koda",
    "cafe\u0301 (e + combining acute)",
    "\u1e9b\u0323 a\u0308\u0304 Z\u0351\u036b\u0343\u036a\u0302",
    # Other scripts.
    "\u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u039a\u03cc\u03c3\u03bc\u03b5",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440!",
    "\u4f60\u597d\uff0c\u4e16\u754c\u3002",
    "\u3053\u3093\u306b\u3061\u306f \u30ab\u30bf\u30ab\u30ca \u6f22\u5b57",
    "\uc548\ub155\ud558\uc138\uc694 \uc138\uacc4",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35 \u05e9\u05dc\u05d5\u05dd "
    "\u10d2\u10d0\u10db\u10d0\u10e0\u10ef\u10dd\u10d1\u10d0",
    "Arabic-Indic digits \u0661\u0662\u0663 and fullwidth \uff11\uff12\uff13 and \u00bd \u2167",
    # Emoji and symbols.
    "\U0001f600",
    "thumbs \U0001f44d\U0001f3fd up",
    "family \U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 together",
    "flags \U0001f1ef\U0001f1f5 \U0001f1e9\U0001f1ea \U0001f3f4\u200d\u2620\ufe0f",
    "\u2764\ufe0f \u2603 \u2192 \u221e \u2211 \u00a9 \u2122",
    # Unusual whitespace and invisible characters.
    "non\u00a0breaking\u00a0space",
    "zero\u200bwidth\u200bspace",
    "ideographic\u3000space \u3000 here",
    "next line\u0085and line\u2028separator\u2029paragraph",
    "mongolian\u180evowel separator",
    "en\u2002em\u2003thin\u2009spaces",
    "soft\u00adhyphen and \ufeffBOM",
    "control \x00 \x01 \x1b[0m \x7f chars",
    "\u00a0 \u00a0leading odd spaces",
    # Long runs.
    "pneumonoultramicroscopicsilicovolcanoconiosis",
    "a" * 300,
    "9" * 80,
    "\u00e9" * 150,
    "ab" * 200 + " " + "-=" * 50,
]


def text_cases(text: pathlib.Path) -> list[str]:
    """A few lines of real text, alone and joined, as realistic prompts."""
    lines = [line for line in text.read_text(encoding="utf-8").splitlines() if line]
    picked = lines[::12]
    return picked + ["\n".join(lines[60:64])]


def parse_args() -> argparse.Namespace:
    parser = argument_parser(__doc__)
    add_path_argument(
        parser, "--tokenizer-dir", "configs/tokenizer", "directory with vocab.json and merges.txt"
    )
    add_path_argument(
        parser, "--text", "configs/calibration.txt", "real text some cases are taken from"
    )
    add_path_argument(parser, "--out", "tests/fixtures/tokenizer_cases.json", "fixture to write")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    tokenizer = ByteLevelBPETokenizer(
        str(args.tokenizer_dir / "vocab.json"),
        str(args.tokenizer_dir / "merges.txt"),
        add_prefix_space=False,
    )
    cases = []
    for text in CASES + text_cases(args.text):
        ids = tokenizer.encode(text).ids
        cases.append({"text": text, "ids": ids, "decoded": tokenizer.decode(ids)})

    write_json(args.out, cases)
    print(f"wrote {args.out}: {len(cases)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
