"""A BM25 index over passages, backed by `bm25s` (Lucene's BM25 variant, sparse scores in numpy).

Why bm25s and not rank_bm25 (measured on 10k synthetic passages, one CPU thread; bench/env_search.py re-measures):
scoring one query takes ~0.02 ms with `bm25s.BM25.get_scores` (it keeps a sparse term-by-document matrix) against
~13 ms with `rank_bm25.BM25Okapi.get_scores` (a Python loop over every document per query term); both are pure Python
+ numpy, need nothing from the network, and pickle to 2 MB. bm25s' own `retrieve` adds ~0.4 ms of per-call set-up
(progress bars, thread pool), so `search` scores with `get_scores` and takes the top k itself.

Determinism: passages and queries are tokenised here (lower-cased word characters, a short English stop-word list), not
by bm25s' tokenizer, and ties are broken by passage position (lower first), never by `argpartition`'s arbitrary order;
so the same passages and query give the same hits in every process.

Processes: the index is built lazily, on the first `search`, and pickles as its passages and parameters only (the
built matrix is dropped and rebuilt where it is unpickled), so it crosses Dask cheaply. Envs keep one per process
(`astratk.envs.search.env`): ~0.3 s to build at 10k passages, once per worker process.

Example:
    >>> index = BM25Index(["Ada Marr was born in Tevlin.", "Tevlin is a city in Orvania."])
    >>> index.search("Where was Ada Marr born?", k=1)[0][0]
    0
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

# Function words that carry no retrieval signal (question words included: every query has one). Kept here rather than
# taken from bm25s so that tokenising a query never imports bm25s.
STOPWORDS = frozenset((
    "a", "an", "and", "are", "as", "at", "be", "been", "being", "but", "by", "did", "do", "does", "for", "from",
    "had", "has", "have", "he", "her", "his", "how", "i", "if", "in", "into", "is", "it", "its", "of", "on", "or",
    "she", "so", "than", "that", "the", "their", "them", "then", "there", "these", "they", "this", "those", "to",
    "was", "were", "what", "when", "where", "which", "who", "whom", "whose", "why", "will", "with",
))

_WORD = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
    """Lower-cased words minus stop words: the one tokenisation for passages and queries."""
    return [w for w in _WORD.findall(text.lower()) if w not in STOPWORDS]


class BM25Index:
    """Top-k BM25 search over `texts` (k1, b: the usual BM25 parameters; Lucene's IDF)."""

    def __init__(self, texts: Sequence[str], *, k1: float = 1.5, b: float = 0.75) -> None:
        if not texts:
            raise ValueError("BM25Index needs at least one passage")
        if k1 < 0 or not 0 <= b <= 1:
            raise ValueError(f"BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={k1}, b={b}")
        self.texts = tuple(texts)
        self.k1, self.b = float(k1), float(b)
        self._bm25: Any = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.texts)

    def __repr__(self) -> str:
        return f"BM25Index({len(self.texts)} passages, k1={self.k1}, b={self.b}, built={self._bm25 is not None})"

    def __getstate__(self) -> dict[str, Any]:
        return {"texts": self.texts, "k1": self.k1, "b": self.b}  # the built matrix is rebuilt where it is needed

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["texts"], k1=state["k1"], b=state["b"])  # type: ignore[misc]

    def build(self) -> BM25Index:
        """Build now (otherwise the first `search` does); returns self."""
        with self._lock:  # episodes in several threads of one worker share the index: build it once
            if self._bm25 is None:
                try:  # imported here: ~0.2 s (tqdm, numpy extras), and only processes that search need it
                    import bm25s
                except ImportError as e:
                    raise ImportError(f"the search env's BM25 index needs bm25s: pip install 'bm25s>=0.3.11,<0.4' "
                                      f"({e})") from e

                vocab: dict[str, int] = {}
                ids = [[vocab.setdefault(w, len(vocab)) for w in tokenize(t)] for t in self.texts]
                model = bm25s.BM25(k1=self.k1, b=self.b, method="lucene", backend="numpy")
                model.index(bm25s.tokenization.Tokenized(ids=ids, vocab=vocab), show_progress=False)
                self._bm25 = model
        return self

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        """(passage position, score) of the k best passages, best first, ties by position. Passages that share no
        term with the query score 0 and are never returned, so a query of unknown words gives []."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        bm25 = self._bm25 if self._bm25 is not None else self.build()._bm25
        # bm25s drops unknown words itself, but indexes query[0] first, so an empty list must not reach it
        ids = [bm25.vocab_dict[w] for w in tokenize(query) if w in bm25.vocab_dict]
        if not ids:
            return []
        scores = bm25.get_scores(ids)  # [n_passages] float32
        positive = int(np.count_nonzero(scores > 0))
        k = min(k, positive)
        if k == 0:
            return []
        # The k-th best score, then every passage at or above it (ties at the boundary included), ordered by
        # (-score, position): deterministic where argpartition alone is not.
        threshold = np.partition(scores, len(scores) - k)[len(scores) - k]
        candidates = np.flatnonzero(scores >= threshold)
        order = candidates[np.lexsort((candidates, -scores[candidates]))][:k]
        return [(int(i), float(scores[i])) for i in order]
