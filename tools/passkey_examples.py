"""Passkey retrieval examples for training the built-in models (tools/train_model.py
--retrieval-share) and for watching their retrieval while they train.

An example is the prompt `infinigen eval --task passkey` builds, from the template it reads by
default (configs/passkey/template.json): BOS, the intro, filler text with the needle (which
states the key) at a chosen depth, the question; then the answer, the key after a space and a
full stop. Here the filler is a random stretch of the training corpus (its documents' BOS
removed), the depth is uniform in [0, 1], the length uniform between a floor and the context,
and the key five random digits, a random word of the corpus or its vocabulary, or a word spelled
from random pieces; the eval uses fillers, keys and depths of its own.

Every example is drawn from a generator seeded by the caller, so a resumed training run sees the
same examples as an uninterrupted one.
"""

import json
import pathlib
import re

import numpy as np

TEMPLATE = pathlib.Path(__file__).resolve().parent.parent / "configs" / "passkey" / "template.json"


class PasskeyExamples:
    """Builds passkey examples as token ids with the training tokenizer."""

    def __init__(self, tokenizer, tokens: np.ndarray, bos_id: int,
                 template: pathlib.Path = TEMPLATE, word_share: float = 0.25):
        strings = json.loads(template.read_text(encoding="utf-8"))
        self.tokenizer = tokenizer
        self.bos_id = bos_id
        self.intro = tokenizer.encode(strings["intro"]).ids
        self.question = tokenizer.encode(strings["question"]).ids
        self.needle = strings["needle"]
        # The corpus stream without its documents' BOS: filler is drawn from it.
        self.filler = tokens[tokens != bos_id]
        # Words of the corpus for word keys: lower-case, 4 to 9 letters, seen at least 20 times.
        sample = tokenizer.decode(self.filler[: min(len(self.filler), 400_000)].tolist())
        counts: dict[str, int] = {}
        for word in re.findall(r"\b[a-z]{4,9}\b", sample):
            counts[word] = counts.get(word, 0) + 1
        corpus_words = {w for w, c in counts.items() if c >= 20}
        # And the vocabulary's lower-case alphabetic pieces of 4 to 9 letters: a copy learnt on
        # corpus words alone does not reach words the corpus lacks (a key is any word).
        pieces = {tokenizer.decode([i]).strip() for i in range(tokenizer.get_vocab_size())}
        vocabulary_words = {p for p in pieces if re.fullmatch(r"[a-z]{4,9}", p)}
        self.words = sorted(corpus_words | vocabulary_words)
        # Both are mostly one token each (a word seen 20 times has earned its merge), while an
        # English word the corpus rarely uses is two to four pieces ("pencil": pen, c, il). Half
        # the word keys are therefore spelled from 2 to 4 random lower-case pieces of 1 to 5
        # letters, 4 to 9 in all: a copy of one token does not carry over to a copy of several.
        self.pieces = sorted(p for p in pieces if re.fullmatch(r"[a-z]{1,5}", p))
        self.word_share = word_share

    def key(self, rng: np.random.Generator) -> str:
        if rng.random() >= self.word_share:
            return str(int(rng.integers(10_000, 100_000)))
        if rng.random() < 0.5:
            return self.words[int(rng.integers(len(self.words)))]
        while True:
            count = int(rng.integers(2, 5))
            word = "".join(self.pieces[int(rng.integers(len(self.pieces)))] for _ in range(count))
            if 4 <= len(word) <= 9:
                return word

    def example(self, length: int, depth: float, key: str,
                rng: np.random.Generator) -> tuple[list[int], list[int], tuple[int, int]]:
        """(prompt, answer, repeat): the prompt exactly `length` tokens, BOS first; `repeat`, the
        prompt's tokens of the needle after the key's first mention (where the needle states it
        again: a short-range copy), or (0, 0) where the tokenizer merges across that point."""
        needle_text = self.needle.replace("{key}", key)
        needle = self.tokenizer.encode(needle_text).ids
        first = self.tokenizer.encode(needle_text[:self.needle.index("{key}") + len(key)]).ids
        answer = self.tokenizer.encode(f" {key}.").ids
        room = length - 1 - len(self.intro) - len(needle) - len(self.question)
        if room < 0:
            raise ValueError(f"a passkey prompt of {length} tokens has no room for its filler")
        start = int(rng.integers(0, len(self.filler) - room))
        filler = self.filler[start:start + room].tolist()
        at = int(round(depth * room))
        prompt = [self.bos_id] + self.intro + filler[:at] + needle + filler[at:] + self.question
        needle_at = 1 + len(self.intro) + at
        repeat = ((needle_at + len(first), needle_at + len(needle))
                  if needle[:len(first)] == first else (0, 0))
        return prompt, answer, repeat

    def batch(self, rows: int, length: int, seed: int,
              edge_share: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """(rows, length + answer) ids and labels of one length: the labels are -100 except on
        the answer's tokens and the needle's repeat of the key, the only ones trained on (the
        corpus rows train the language; the repeat, a copy over a few tokens, is the easy case
        of the answer's copy over the whole prompt). A share `edge_share` of the examples puts
        the key at depth 0 or 1 (half each), the others at a uniform depth: the prompt's two
        ends, the farthest from the question and the nearest, are otherwise rare."""
        rng = np.random.default_rng(seed)
        examples = []
        for _ in range(rows):
            key = self.key(rng)
            edge = rng.random() < edge_share
            depth = float(rng.integers(0, 2)) if edge else float(rng.random())
            examples.append(self.example(length, depth, key, rng))
        width = length + max(len(answer) for _, answer, _ in examples)
        ids = np.full((rows, width), self.bos_id, dtype=np.int64)
        labels = np.full((rows, width), -100, dtype=np.int64)
        for row, (prompt, answer, (repeat_from, repeat_to)) in enumerate(examples):
            ids[row, :length] = prompt
            ids[row, length:length + len(answer)] = answer
            # Labels are the ids themselves; the model shifts them by one.
            labels[row, length:length + len(answer)] = answer
            labels[row, repeat_from:repeat_to] = ids[row, repeat_from:repeat_to]
        return ids, labels


def greedy_key_accuracy(model, examples: PasskeyExamples, lengths: list[int],
                        depths: list[float], trials: int, seed: int) -> dict:
    """Share of exact keys a greedy continuation gives, per length and overall (HF model)."""
    import torch

    rng = np.random.default_rng(seed)
    model.eval()
    per_length, correct_total, total = {}, 0, 0
    with torch.no_grad():
        for length in lengths:
            correct = 0
            for depth in depths:
                for _ in range(trials):
                    key = examples.key(rng)
                    prompt, answer, _ = examples.example(length, depth, key, rng)
                    ids = torch.tensor([prompt], device=model.device)
                    generated = []
                    past = None
                    for _ in range(len(answer)):
                        out = model(input_ids=ids, past_key_values=past, use_cache=True)
                        past = out.past_key_values
                        token = int(out.logits[0, -1].argmax())
                        generated.append(token)
                        ids = torch.tensor([[token]], device=model.device)
                    text = examples.tokenizer.decode(generated).strip()
                    correct += int(re.match(re.escape(key) + r"(?![0-9A-Za-z])", text) is not None)
            per_length[length] = correct / (len(depths) * trials)
            correct_total += correct
            total += len(depths) * trials
    model.train()
    return {"overall": correct_total / total, "per_length": per_length}
