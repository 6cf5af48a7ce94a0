"""Trains the bundled byte-level BPE tokenizer on the training split of tools/make_corpus.py.

The result is a GPT-2/OPT-style vocabulary (vocab.json + merges.txt) of 8192 tokens: the built-in
model's tokenizer (models/builtin), which the engine also embeds for the synthetic presets. The special tokens come first so that their ids match OPT's
conventions: <s> = 0, <pad> = 1, </s> = 2 (OPT's BOS and EOS), <unk> = 3.

Training is deterministic for a given corpus and `tokenizers` version (see tools/requirements.txt):
running the script twice writes byte-identical files.

Usage:
    python tools/make_corpus.py --out build/corpus
    python tools/train_tokenizer.py [--corpus build/corpus/train.txt] [--out-dir DIR]
"""

import argparse
import sys

from tokenizers import ByteLevelBPETokenizer

from tokenizer_common import add_path_argument, argument_parser, write_json

SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>"]


def parse_args() -> argparse.Namespace:
    parser = argument_parser(__doc__)
    add_path_argument(parser, "--corpus", "build/corpus/train.txt", "training text, UTF-8")
    add_path_argument(
        parser, "--out-dir", "configs/tokenizer", "where vocab.json and merges.txt are written"
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=8192,
        help="exact number of tokens, special tokens included (default: %(default)s)",
    )
    parser.add_argument(
        "--min-frequency",
        type=int,
        default=2,
        help="a pair must occur this often to be merged (default: %(default)s)",
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    tokenizer = ByteLevelBPETokenizer(add_prefix_space=False)
    tokenizer.train(
        files=[str(args.corpus)],
        vocab_size=args.vocab_size,
        min_frequency=args.min_frequency,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )

    vocab = tokenizer.get_vocab()
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if vocab.get(token) != expected_id:
            got = vocab.get(token)
            print(f"error: {token} got id {got}, expected {expected_id}", file=sys.stderr)
            return 1
    # The engine and the synthetic models rely on a dense id range of exactly --vocab-size.
    if sorted(vocab.values()) != list(range(args.vocab_size)):
        print(
            f"error: trained {len(vocab)} tokens, expected ids 0..{args.vocab_size - 1}; "
            "lengthen the corpus or lower --min-frequency",
            file=sys.stderr,
        )
        return 1

    args.out_dir.mkdir(parents=True, exist_ok=True)
    written = tokenizer.save_model(str(args.out_dir))
    # save_model already writes ids in order; rewrite vocab.json with one entry per line so that
    # diffs stay readable when the corpus changes.
    ordered = dict(sorted(vocab.items(), key=lambda item: item[1]))
    write_json(args.out_dir / "vocab.json", ordered, indent=0)

    with open(args.out_dir / "merges.txt", encoding="utf-8") as merges_file:
        merges = sum(1 for line in merges_file if line.strip() and not line.startswith("#version"))
    for path in written:
        print(f"wrote {path}")
    print(f"vocabulary: {len(vocab)} tokens ({len(SPECIAL_TOKENS)} special), {merges} merges")
    return 0


if __name__ == "__main__":
    sys.exit(main())
