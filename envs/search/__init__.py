"""The search env family: a multi-turn retrieval agent over a local BM25-indexed corpus, scored by answer F1/EM.

`SearchEnv` (env.py) runs episodes; `SyntheticCorpus` (corpus.py) invents a fact world with single- and multi-hop
questions; `JsonlCorpus` (jsonl.py) reads a user's passages and QA files; `BM25Index` (index.py) wraps bm25s.
"""

from astratk.envs.search.corpus import Corpus, Passage, Question, SyntheticCorpus
from astratk.envs.search.env import SearchEnv, exact_match, f1_score, normalize_answer
from astratk.envs.search.index import BM25Index
from astratk.envs.search.jsonl import JsonlCorpus, load_passages, load_qa

__all__ = ["BM25Index", "Corpus", "JsonlCorpus", "Passage", "Question", "SearchEnv", "SyntheticCorpus", "exact_match",
           "f1_score", "load_passages", "load_qa", "normalize_answer"]
