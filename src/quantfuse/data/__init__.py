"""Data bundled with quantfuse.

`sentences.txt`: English sentences written for this project (everyday scenes, questions and
exclamations, science, history, business, health, sport, arts, nature, software), one per line. The
demo calibrates static INT8 on them and measures each scheme's cosine against fp32 embeddings on them.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from typing import List, Optional

SENTENCES_FILE = "sentences.txt"


@lru_cache(maxsize=None)
def _read() -> tuple:
    text = resources.files(__name__).joinpath(SENTENCES_FILE).read_text(encoding="utf-8")
    return tuple(line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))


def load_sentences(limit: Optional[int] = None) -> List[str]:
    """The bundled sentences, in file order (the first `limit` of them when given)."""
    sentences = list(_read())
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit: expected a non-negative integer or None, got {limit!r}")
        sentences = sentences[:limit]
    return sentences


__all__ = ["load_sentences", "SENTENCES_FILE"]
