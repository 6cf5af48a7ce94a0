"""Builds small HF tokenizer.json tokenizers and their reference encodings for the C++ tests.

Five tokenizers are built with HF `tokenizers` (the version pinned in tools/requirements.txt),
trained on text this repository keeps unchanged (configs/calibration.txt and a held-out test
text; documentation would change the fixtures with every edit), each laid out like a real model
family's tokenizer.json, and saved as tests/fixtures/tokenizers/<name>/tokenizer.json with its
tokenizer_config.json:

  llama3   byte-level BPE: Split on Llama-3's pattern + ByteLevel(use_regex=false),
           ignore_merges (with words no merge reaches), special tokens after the vocabulary,
           a TemplateProcessing post-processor adding <|begin_of_text|>, and added tokens with
           lstrip, rstrip and single_word;
  qwen2    byte-level BPE: NFC normalizer, Split on Qwen2's pattern + ByteLevel, no BOS, and a
           non-special added token whose content the normalizer changes;
  llama2   SentencePiece-style BPE: normalizer Prepend("▁") + Replace(" ", "▁"), no
           pre-tokenizer, byte_fallback with the <0x00>..<0xFF> tokens, <unk>/<s>/</s>,
           decoder Replace + ByteFallback + Fuse + Strip, TemplateProcessing "<s> $A", and a
           non-special added token that the normalizer rewrites;
  mistral  the same vocabulary in the Metaspace form: normalizer Replace(" ", "▁"),
           pre-tokenizer Metaspace(prepend_scheme="first", split=false), decoder ByteFallback +
           Metaspace;
  metaspace  the same vocabulary without byte fallback (characters outside it become <unk>,
           fused): pre-tokenizer Metaspace(prepend_scheme="always", split=true), decoder
           Metaspace, and a tokenizer_config.json with add_bos_token false.

tests/fixtures/tokenizers/cases.json then holds, for every tokenizer and every stress string,
the ids `encode(text, add_special_tokens=False)` gives and `decode(ids)` with and without
skip_special_tokens; `decode` of id sequences no encoding gives (characters cut in the middle,
random ids); and the ids `encode("", add_special_tokens=True)` gives (the BOS the post-processor
adds). The stress strings are those of make_tokenizer_fixture.py and EXTRA_CASES below, then
lines of real text. Training is deterministic: running the script again rewrites the same files.

Usage:
    python tools/make_tokenizer_json_fixtures.py [--out DIR]
"""

import argparse
import collections
import json
import pathlib
import random
import sys

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors, trainers

from make_tokenizer_fixture import CASES as BYTE_LEVEL_CASES
from tokenizer_common import REPO_ROOT, add_path_argument, argument_parser, write_json

# The pre-tokenisation patterns exactly as Llama-3's and Qwen2's tokenizer.json spell them.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

UNMERGED_WORDS = ["\u0120quokka", "quokka", "\u0120QUOKKA"]  # byte-level spelling: "\u0120" is " "

LLAMA3_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
QWEN2_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Strings beyond the byte-level ones of make_tokenizer_fixture.py: what the tokenizer.json forms
# add (special tokens in the text, Metaspace and Prepend around them, digit groups, contractions
# in upper case, decomposed characters for NFC, characters no SentencePiece token covers).
EXTRA_CASES = [
    "quokka quokka QUOKKA Quokka quokkas",
    "1234567",
    "12 345 6789 0.5 1e10",
    "IT'S I'M YOU'LL WE'VE THEY'RE SHE'D DON'T",
    "It'S mIxEd 'Ll 'rE",
    "x'\u017f and x'\u00df and x'K",
    "   leading spaces",
    "trailing spaces   ",
    " \t \t mixed\t\t \n \n\n  \r\n\r\n x",
    "\r\n",
    "a\r\n\r\nb\n\r c",
    "\n\n\n",
    "word\u180eword",
    "\u180e! !\u180e  \u180e \u180ea \u180e1 \u180e  x",
    "e\u0301 cafe\u0301 A\u030a \u1100\u1161\u11a8 \u212b \u2126",
    "nai\u0308ve na\u00efve",
    "\u00e9t\u00e9 \u00c9T\u00c9 \u0130stanbul",
    "\u2581already\u2581metaspace \u2581",
    "<s>",
    "<s>Hello",
    "Hello<s>",
    "<s> Hello </s> world",
    "a</s>b<unk>c<s>",
    "<s><s></s>",
    "<|begin_of_text|>Hello<|eot_id|>",
    "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>",
    " <|end_of_text|> ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>",
    "<|endoftext|><|endoftext|>",
    "a <mask> b  \t<mask>c<mask>",
    "x [sep]   y [sep]\n\nz[sep]",
    "gen, gen world, agen, gena, _gen, gen_, 1gen, \u00e9gen, gen\u0301, \u00bdgen, gen\u200d",
    "ab c ab  c xab cx \u2581ab\u2581c",
    "<|begin_of_text|",
    "<s",
    "na\u00efve and naive",
    "\U0001f916\U0001f680 \u2603\ufe0f \U0001f3f3\ufe0f\u200d\U0001f308",
    "\u0915\u094d\u0937 \u0dc1\u0dca\u200d\u0dbb\u0dd3 \u1780\u17d2\u1798\u17c2\u179a",
    "\ufffd replacement \ufffd\ufffd",
    "\u00a0\u3000 \u2009x",
    "    def main():\n        return 0\n",
    "tab\tafter\ttab\t",
]


HELDOUT = REPO_ROOT / "tests" / "fixtures" / "heldout"


def training_text() -> list[str]:
    """The repository text the tokenizers learn from, in a fixed order."""
    paths = [REPO_ROOT / "configs" / "calibration.txt", HELDOUT / "kjv_Hosea.txt"]
    lines = []
    for path in paths:
        lines += [line for line in path.read_text(encoding="utf-8").splitlines() if line]
    return lines


def train_byte_level(pattern: str, vocab_size: int, normalizer, ignore_merges: bool) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    return tokenizer


def make_llama3() -> tuple[Tokenizer, dict]:
    tokenizer = train_byte_level(LLAMA3_PATTERN, 1500, None, ignore_merges=True)
    # Words in the vocabulary that no merge reaches, as in Llama-3's (converted from tiktoken):
    # only ignore_merges encodes them whole.
    trained = json.loads(tokenizer.to_str())["model"]
    vocab = trained["vocab"]
    for word in UNMERGED_WORDS:
        vocab[word] = len(vocab)
    tokenizer.model = models.BPE(
        vocab=vocab, merges=[tuple(m) for m in trained["merges"]], ignore_merges=True
    )
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIAL]
        + [AddedToken("<mask>", special=True, normalized=False, lstrip=True)]
    )
    tokenizer.add_tokens(
        [
            AddedToken("[sep]", special=False, normalized=False, rstrip=True),
            AddedToken("gen", special=False, normalized=False, single_word=True),
        ]
    )
    bos = LLAMA3_SPECIAL[0]
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
            processors.TemplateProcessing(
                single=f"{bos} $A",
                pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, tokenizer.token_to_id(bos))],
            ),
        ]
    )
    config = {
        "bos_token": bos,
        "eos_token": "<|end_of_text|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    return tokenizer, config


def make_qwen2() -> tuple[Tokenizer, dict]:
    tokenizer = train_byte_level(QWEN2_PATTERN, 1200, normalizers.NFC(), ignore_merges=False)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in QWEN2_SPECIAL]
    )
    # Decomposed on purpose: HF matches it in NFC-normalized text and decodes it composed.
    tokenizer.add_tokens([AddedToken("nai\u0308ve", special=False, normalized=True)])
    tokenizer.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    config = {
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "add_prefix_space": False,
        "tokenizer_class": "Qwen2Tokenizer",
    }
    return tokenizer, config


def sentencepiece_model(byte_fallback: bool) -> models.BPE:
    """A Llama-2-like BPE: <unk> <s> </s>, the 256 byte tokens, then merged pieces."""
    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="always", split=True
    )
    # The characters seen at least 20 times, so that rarer ones take the byte fallback. Given as
    # the whole alphabet: the trainer's own limit_alphabet breaks ties in hash order, which
    # changes from run to run.
    counts = collections.Counter("".join(training_text()).replace(" ", "\u2581"))
    alphabet = sorted(c for c, n in counts.items() if n >= 20)
    trainer = trainers.BpeTrainer(
        vocab_size=1100,
        min_frequency=2,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    trainer_tokenizer.train_from_iterator(training_text(), trainer=trainer)
    trained = json.loads(trainer_tokenizer.to_str())["model"]

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for token, _ in sorted(trained["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    return models.BPE(
        vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=byte_fallback
    )


def sentencepiece_specials(tokenizer: Tokenizer) -> None:
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )


def make_llama2(model: models.BPE) -> tuple[Tokenizer, dict]:
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    sentencepiece_specials(tokenizer)
    # HF matches it as the normalizer writes it, "▁ab▁c", and decodes it so.
    tokenizer.add_tokens([AddedToken("ab c", special=False, normalized=True)])
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False,
                      "normalized": False, "rstrip": False, "single_word": False},
        "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False,
                      "normalized": False, "rstrip": False, "single_word": False},
        "unk_token": "<unk>",
        "tokenizer_class": "LlamaTokenizer",
    }
    return tokenizer, config


def make_mistral(model: models.BPE) -> tuple[Tokenizer, dict]:
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first", split=False
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.ByteFallback(),
            decoders.Metaspace(replacement="\u2581", prepend_scheme="first", split=False),
        ]
    )
    sentencepiece_specials(tokenizer)
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "legacy": False,
        "tokenizer_class": "LlamaTokenizer",
    }
    return tokenizer, config


def make_metaspace(model: models.BPE) -> tuple[Tokenizer, dict]:
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="always", split=True
    )
    tokenizer.decoder = decoders.Metaspace(
        replacement="\u2581", prepend_scheme="always", split=True
    )
    sentencepiece_specials(tokenizer)
    config = {"add_bos_token": False, "bos_token": "<s>", "eos_token": "</s>"}
    return tokenizer, config


def cases_of(tokenizer: Tokenizer, texts: list[str]) -> list[dict]:
    cases = []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        cases.append(
            {
                "text": text,
                "ids": ids,
                "decoded": tokenizer.decode(ids, skip_special_tokens=True),
                "decoded_with_special": tokenizer.decode(ids, skip_special_tokens=False),
            }
        )
    return cases


def decode_cases_of(tokenizer: Tokenizer) -> list[dict]:
    """Id sequences no encoding gives: cut characters, reordered and random ids (seeded)."""
    ids = tokenizer.encode(
        "caf\u00e9 \U0001f600 \u4f60\u597d <s></s> It's", add_special_tokens=False
    ).ids
    sequences = [ids[:-2], ids[1:], ids[::-1], ids[::2], ids[1::3]]
    for text in ["\U0001f600", "\u4f60\u597d", " \u00e9", "\U0001f600x"]:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        sequences += [ids[:-1], ids[1:], ids[1:] + ids[:-1]]
    rng = random.Random(7)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    sequences += [[rng.randrange(size) for _ in range(12)] for _ in range(20)]
    return [
        {
            "ids": sequence,
            "decoded": tokenizer.decode(sequence, skip_special_tokens=True),
            "decoded_with_special": tokenizer.decode(sequence, skip_special_tokens=False),
        }
        for sequence in sequences
    ]


def real_text_cases() -> list[str]:
    """A few lines of the training text and of text the tokenizers never saw."""
    lines = training_text()
    unseen = (HELDOUT / "python-doc_howto_curses.rst.txt").read_text(encoding="utf-8")
    unseen_lines = [line for line in unseen.splitlines() if line.strip()]
    return lines[::97][:12] + ["\n".join(lines[40:44])] + unseen_lines[::60][:8]


def write_cases(path: pathlib.Path, fixture: dict) -> None:
    """cases.json with one case a line, so that diffs stay readable and the file small."""
    lines = ["{"]
    for i, (name, entry) in enumerate(fixture.items()):
        bos_ids = json.dumps(entry["bos_ids"])
        lines.append(f' {json.dumps(name)}: {{"bos_ids": {bos_ids}, "cases": [')
        cases = [f"  {json.dumps(case, ensure_ascii=False)}" for case in entry["cases"]]
        lines.append(",\n".join(cases))
        lines.append(' ], "decode_cases": [')
        cases = [f"  {json.dumps(case, ensure_ascii=False)}" for case in entry["decode_cases"]]
        lines.append(",\n".join(cases))
        lines.append(" ]}" + ("," if i + 1 < len(fixture) else ""))
    lines.append("}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", newline="\n")


def parse_args() -> argparse.Namespace:
    parser = argument_parser(__doc__)
    add_path_argument(parser, "--out", "tests/fixtures/tokenizers", "directory to write")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    tokenizers = {
        "llama3": make_llama3(),
        "qwen2": make_qwen2(),
        "llama2": make_llama2(sentencepiece_model(byte_fallback=True)),
        "mistral": make_mistral(sentencepiece_model(byte_fallback=True)),
        "metaspace": make_metaspace(sentencepiece_model(byte_fallback=False)),
    }
    texts = BYTE_LEVEL_CASES + EXTRA_CASES + real_text_cases()
    fixture = {}
    for name, (tokenizer, config) in tokenizers.items():
        directory = args.out / name
        directory.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(directory / "tokenizer.json"), pretty=False)
        write_json(directory / "tokenizer_config.json", config)
        # Read back, so that the cases come from the file exactly as the C++ side reads it.
        saved = Tokenizer.from_file(str(directory / "tokenizer.json"))
        fixture[name] = {
            "bos_ids": saved.encode("", add_special_tokens=True).ids,
            "cases": cases_of(saved, texts),
            "decode_cases": decode_cases_of(saved),
        }
    write_cases(args.out / "cases.json", fixture)
    total = sum(len(f["cases"]) for f in fixture.values())
    print(f"wrote {args.out}: {len(tokenizers)} tokenizers, {total} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
