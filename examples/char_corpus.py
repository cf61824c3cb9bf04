"""A character-level corpus: encoding, its unigram entropy, and deterministic batches.

The default corpus (`examples/data/shakespeare.txt`, ~200 KB) is public-domain Shakespeare: the
first 200 KB of the "tiny shakespeare" file of karpathy/char-rnn.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

DEFAULT_CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                              "shakespeare.txt")


@dataclasses.dataclass(frozen=True)
class CharCorpus:
  """tokens: int32 [N] indices into `chars` (the sorted distinct characters)."""

  chars: str
  tokens: np.ndarray

  @classmethod
  def load(cls, path: str = DEFAULT_CORPUS) -> "CharCorpus":
    with open(path, encoding="utf-8") as f:
      text = f.read()
    if len(text) < 1000:
      raise ValueError(f"corpus {path!r} has {len(text)} characters; need at least 1000")
    chars = "".join(sorted(set(text)))
    lut = {c: i for i, c in enumerate(chars)}
    return cls(chars, np.array([lut[c] for c in text], np.int32))

  @property
  def vocab_size(self) -> int:
    return len(self.chars)

  def unigram_entropy(self) -> float:
    """Entropy of the character frequencies in nats: the loss of the best context-free model."""
    p = np.bincount(self.tokens, minlength=self.vocab_size) / self.tokens.size
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())

  def split(self, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(train tokens, validation tokens): the last `val_fraction` held out."""
    cut = int(self.tokens.size * (1 - val_fraction))
    return self.tokens[:cut], self.tokens[cut:]


def batch(tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int = 0
          ) -> np.ndarray:
  """Batch `step`: int32 [B, seq_len + 1] windows at offsets drawn from (seed, step) alone, so
  any process, and a run resumed at any step, draws the same batch."""
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, tokens.size - seq_len - 1, size=batch_size)
  return np.stack([tokens[s:s + seq_len + 1] for s in starts])


def decode(chars: str, ids) -> str:
  return "".join(chars[int(i)] for i in ids)
