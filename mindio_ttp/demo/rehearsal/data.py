"""A tiny training corpus for real-Megatron tests, made at test time.

The text is synthetic (seeded, ~100 KB), the BPE is trained on it (a few hundred merges,
written as GPT-2 ``vocab.json`` / ``merges.txt``), and the ``.bin/.idx`` pair is written by
Megatron's own ``_GPT2BPETokenizer`` and ``indexed_dataset.make_builder``: the path
``tools/preprocess_data.py`` takes, which itself cannot be used because it imports ``nltk``
(``tools/preprocess_data.py:26``). Pre-tokenisation uses Megatron's GPT-2 regex and byte map,
so the merges we learn are the ones its tokenizer applies.

Megatron is imported only in a child process (:func:`make_tiny_dataset` runs this module
as ``python -m``), under :mod:`mindio_ttp.cpu_adaptor`.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

PREFIX_NAME = "tiny_text_document"
EOD = "<|endoftext|>"

_NOUNS = ("cat dog bird fish tree river house city model layer token engine garden "
          "window teacher farmer signal").split()
_VERBS = ("sees finds builds moves holds reads writes likes carries follows paints "
          "counts").split()
_ADJS = "red blue green small large quick lazy old new bright quiet".split()
_LINKS = "and but while because then so".split()
_PLACES = "over under near behind across inside beside".split()


@dataclass(frozen=True)
class TinyDataset:
    """Files of a tiny dataset; ``prefix`` is what ``--data-path`` takes."""

    directory: Path
    prefix: Path
    vocab_file: Path
    merge_file: Path

    @classmethod
    def at(cls, directory: Path) -> TinyDataset:
        directory = Path(directory)
        return cls(directory, directory / PREFIX_NAME, directory / "vocab.json",
                   directory / "merges.txt")

    def exists(self) -> bool:
        return all(p.is_file() for p in (self.vocab_file, self.merge_file,
                                         Path(f"{self.prefix}.bin"), Path(f"{self.prefix}.idx")))


def synthetic_documents(n_docs: int, seed: int) -> List[str]:
    """Seeded English-like documents: a few sentences each, some with numbers."""
    rng = random.Random(seed)

    def phrase() -> str:
        words = ["the", rng.choice(_ADJS), rng.choice(_NOUNS), rng.choice(_VERBS)]
        words += ["a", rng.choice(_NOUNS), rng.choice(_PLACES), "the", rng.choice(_NOUNS)]
        if rng.random() < 0.25:
            words.insert(rng.randrange(len(words)), str(rng.randrange(1000)))
        return " ".join(words)

    docs = []
    for _ in range(n_docs):
        sentences = []
        for _ in range(rng.randint(3, 7)):
            text = phrase()
            if rng.random() < 0.5:
                text += f" {rng.choice(_LINKS)} {phrase()}"
            sentences.append(text[0].upper() + text[1:] + rng.choice(".!?."))
        docs.append(" ".join(sentences))
    return docs


def learn_merges(words: Dict[Tuple[str, ...], int], n_merges: int) -> List[Tuple[str, str]]:
    """Greedy BPE: repeatedly merge the most frequent adjacent pair (ties: smallest pair)."""
    pieces = {w: list(w) for w in words}
    merges: List[Tuple[str, str]] = []
    for _ in range(n_merges):
        counts: collections.Counter = collections.Counter()
        for word, syms in pieces.items():
            for pair in zip(syms, syms[1:]):
                counts[pair] += words[word]
        if not counts:
            break
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append(best)
        joined = best[0] + best[1]
        for word, syms in pieces.items():
            out, i = [], 0
            while i < len(syms):
                if syms[i:i + 2] == list(best):
                    out.append(joined)
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            pieces[word] = out
    return merges


def _write_vocab(ds: TinyDataset, byte_symbols: Sequence[str],
                 merges: Sequence[Tuple[str, str]]) -> None:
    vocab: Dict[str, int] = {}
    for sym in list(byte_symbols) + [a + b for a, b in merges] + [EOD]:
        vocab.setdefault(sym, len(vocab))
    ds.vocab_file.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    lines = ["#version: 0.2"] + [f"{a} {b}" for a, b in merges]
    ds.merge_file.write_text("\n".join(lines) + "\n", encoding="utf-8")


def build(megatron_dir: Path, out_dir: Path, *, n_docs: int = 400, n_merges: int = 300,
          seed: int = 1234) -> TinyDataset:
    """Write corpus, vocab, merges and the indexed dataset (imports Megatron: child only)."""
    import torch

    import mindio_ttp.cpu_adaptor  # noqa: F401  (before megatron)

    sys.path.insert(0, str(megatron_dir))
    from megatron.data import indexed_dataset
    from megatron.tokenizer.gpt2_tokenization import GPT2Tokenizer, bytes_to_unicode
    from megatron.tokenizer.tokenizer import _GPT2BPETokenizer

    ds = TinyDataset.at(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    docs = synthetic_documents(n_docs, seed)
    (out_dir / "corpus.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")

    byte_map = bytes_to_unicode()
    symbols = [byte_map[b] for b in range(256)]
    _write_vocab(ds, symbols, [])  # byte-level only: gives us Megatron's pre-tokeniser
    pretok = GPT2Tokenizer(str(ds.vocab_file), str(ds.merge_file))
    words: collections.Counter = collections.Counter()
    for doc in docs:
        for piece in pretok.pat.findall(doc):
            words[tuple(byte_map[b] for b in piece.encode("utf-8"))] += 1
    _write_vocab(ds, symbols, learn_merges(dict(words), n_merges))

    tokenizer = _GPT2BPETokenizer(str(ds.vocab_file), str(ds.merge_file))
    builder = indexed_dataset.make_builder(f"{ds.prefix}.bin", impl="mmap",
                                           vocab_size=tokenizer.vocab_size)
    for doc in docs:
        builder.add_item(torch.IntTensor(tokenizer.tokenize(doc) + [tokenizer.eod]))
        builder.end_document()
    builder.finalize(f"{ds.prefix}.idx")

    written = indexed_dataset.make_dataset(str(ds.prefix), "mmap", skip_warmup=True)
    if len(written) != len(docs) or tokenizer.detokenize(written[0].tolist()[:-1]) != docs[0]:
        raise RuntimeError(f"indexed dataset at {ds.prefix} does not round-trip")
    return ds


def make_tiny_dataset(megatron_dir: Path, out_dir: Path, *, timeout_s: float = 300,
                      seed: int = 1234) -> TinyDataset:
    """Build the dataset in a child process (no Megatron import here); reuse it if present."""
    ds = TinyDataset.at(out_dir)
    if ds.exists():
        return ds
    cmd = [sys.executable, "-m", __name__, str(megatron_dir), str(out_dir), "--seed", str(seed)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0 or not ds.exists():
        raise RuntimeError(f"building the tiny dataset failed (exit {done.returncode}):\n"
                           f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return ds


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("megatron_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    ds = build(args.megatron_dir.resolve(), args.out_dir.resolve(), seed=args.seed)
    print(f"tiny dataset: {ds.prefix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
