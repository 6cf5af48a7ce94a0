"""Builds the English training corpus of the built-in model from Debian packages.

Sources (install them first: `apt-get install python3.11-doc bible-kjv`):
  - python3.11-doc: the reStructuredText sources of the Python 3.11 documentation, one document
    per source file (library reference, tutorial, how-tos, language reference, ...);
  - bible-kjv: the King James Bible through its `bible` program, one document per book.

Documents are kept whole, never cut into sentences or shuffled lines, because the model must
learn long contexts. The held-out split is fixed by the document's name alone (a hash), so it is
the same on every machine and never depends on the order files are found in:
a document is held out when the first byte of sha256(name) is below HELDOUT_BYTE (about 6%).

Output, in --out (default build/corpus):
  train.jsonl, heldout.jsonl   one {"name", "source", "text"} object per line
  train.txt                    the training documents, each followed by a blank line (tokenizer)
  heldout/NAME.txt             each held-out document as plain text (for `infinigen eval`)
  calibration.txt              the opening of two training documents (CALIBRATION_SOURCES), the
                               default calibration text of `infinigen skew` (configs/)
  manifest.json                package versions, document and byte counts, sha256 of each file

Running it twice on the same package versions writes byte-identical files.

Usage:
    python tools/make_corpus.py [--out DIR]
"""

import argparse
import hashlib
import json
import pathlib
import re
import shutil
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PYTHON_DOC_SOURCES = pathlib.Path("/usr/share/doc/python3.11/html/_sources")
HELDOUT_BYTE = 16  # sha256(name)[0] < 16: 16/256 = 6.25% of documents
# The calibration text: the first CALIBRATION_CHARACTERS characters of each of these training
# documents (prose and technical text, as the two sources are), cut at a line end.
CALIBRATION_SOURCES = ["kjv/Genesis", "python-doc/tutorial/introduction.rst"]
CALIBRATION_CHARACTERS = 6000

# The 66 books in canonical order, as the `bible` program names them.
KJV_BOOKS = [
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth",
    "1 Samuel", "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles", "2 Chronicles", "Ezra",
    "Nehemiah", "Esther", "Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon",
    "Isaiah", "Jeremiah", "Lamentations", "Ezekiel", "Daniel", "Hosea", "Joel", "Amos",
    "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai", "Zechariah",
    "Malachi", "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "1 Corinthians",
    "2 Corinthians", "Galatians", "Ephesians", "Philippians", "Colossians", "1 Thessalonians",
    "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus", "Philemon", "Hebrews", "James",
    "1 Peter", "2 Peter", "1 John", "2 John", "3 John", "Jude", "Revelation",
]


def fail(message: str) -> None:
    print(f"make_corpus: {message}", file=sys.stderr)
    sys.exit(1)


def package_version(package: str) -> str:
    result = subprocess.run(
        ["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True
    )
    if result.returncode != 0 or not result.stdout:
        fail(f"Debian package {package} is not installed (apt-get install {package})")
    return result.stdout


def python_doc_documents() -> list[dict]:
    if not PYTHON_DOC_SOURCES.is_dir():
        fail(f"{PYTHON_DOC_SOURCES} is missing (apt-get install python3.11-doc)")
    documents = []
    for path in sorted(PYTHON_DOC_SOURCES.rglob("*.rst.txt")):
        relative = path.relative_to(PYTHON_DOC_SOURCES).as_posix().removesuffix(".txt")
        text = path.read_text(encoding="utf-8").replace("\r\n", "\n").strip()
        if text:
            documents.append({"name": f"python-doc/{relative}", "source": "python3.11-doc",
                              "text": text})
    return documents


def kjv_book(book: str) -> str:
    # -l sets the line width: wide enough that no verse is wrapped. The program reads "1 Kings"
    # as two words, so the query has no spaces; its headings do ("1 Kings 1").
    query = book.replace(" ", "") + "1:1-999:999"
    result = subprocess.run(["bible", "-l", "100000", query], capture_output=True, text=True)
    if result.returncode != 0:
        fail(f"bible {book}: {result.stderr.strip() or 'failed'}")
    lines = [line.strip() for line in result.stdout.splitlines()]
    text = "\n".join(lines).strip()
    # One blank line between chapters, none inside them.
    text = re.sub(r"\n{3,}", "\n\n", text)
    if not text.startswith(f"{book} 1\n") or len(text) < 1000:
        fail(f"bible {query} did not print the book of {book}")
    return text


def kjv_documents() -> list[dict]:
    if shutil.which("bible") is None:
        fail("the `bible` program is missing (apt-get install bible-kjv)")
    return [{"name": f"kjv/{book}", "source": "bible-kjv", "text": kjv_book(book)}
            for book in KJV_BOOKS]


def is_heldout(name: str) -> bool:
    return hashlib.sha256(name.encode("utf-8")).digest()[0] < HELDOUT_BYTE


def sha256_of(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_jsonl(path: pathlib.Path, documents: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as out:
        for document in documents:
            out.write(json.dumps(document, ensure_ascii=False, sort_keys=True) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT / "build" / "corpus",
                        help="output directory (default: %(default)s)")
    args = parser.parse_args()

    versions = {package: package_version(package) for package in ("python3.11-doc", "bible-kjv")}
    documents = python_doc_documents() + kjv_documents()
    train = [d for d in documents if not is_heldout(d["name"])]
    heldout = [d for d in documents if is_heldout(d["name"])]

    staging = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "heldout").mkdir(parents=True)
    write_jsonl(staging / "train.jsonl", train)
    write_jsonl(staging / "heldout.jsonl", heldout)
    with open(staging / "train.txt", "w", encoding="utf-8", newline="\n") as out:
        for document in train:
            out.write(document["text"] + "\n\n")
    for document in heldout:
        file_name = re.sub(r"[^A-Za-z0-9._-]+", "_", document["name"]) + ".txt"
        (staging / "heldout" / file_name).write_text(document["text"] + "\n", encoding="utf-8")

    by_name = {d["name"]: d for d in train}
    calibration = []
    for name in CALIBRATION_SOURCES:
        if name not in by_name:
            fail(f"calibration source {name} is not a training document")
        text = by_name[name]["text"][:CALIBRATION_CHARACTERS]
        calibration.append(text[: text.rfind("\n")].rstrip())
    (staging / "calibration.txt").write_text("\n\n".join(calibration) + "\n", encoding="utf-8")

    def summary(docs: list[dict]) -> dict:
        by_source = {}
        for d in docs:
            entry = by_source.setdefault(d["source"], {"documents": 0, "characters": 0})
            entry["documents"] += 1
            entry["characters"] += len(d["text"])
        return by_source

    manifest = {
        "packages": versions,
        "heldout_rule": f"sha256(name)[0] < {HELDOUT_BYTE}",
        "train": summary(train),
        "heldout": summary(heldout),
        "heldout_documents": [d["name"] for d in heldout],
        "sha256": {name: sha256_of(staging / name)
                   for name in ("train.jsonl", "heldout.jsonl", "train.txt")},
    }
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(args.out, ignore_errors=True)
    staging.rename(args.out)

    for split, docs in (("train", train), ("heldout", heldout)):
        chars = sum(len(d["text"]) for d in docs)
        print(f"{split}: {len(docs)} documents, {chars / 1e6:.2f} M characters")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
