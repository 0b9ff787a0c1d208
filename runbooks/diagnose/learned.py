"""The learned component of the diagnosis: class probabilities for an incident's evidence text
from a linear model trained on the corpus (PURE but for reading the packaged model once).

The model is TF-IDF over words (and adjacent-word pairs) and character 3-5-grams inside words,
then a multinomial logistic regression, trained by ``scripts/build_model.py`` on ``tests/corpus``
with scikit-learn (a build dependency only). What ships is data, never code:
``knowledge/model.npz`` holds the vocabulary, idf weights, coefficients and the calibration
(a temperature) and the threshold the build chose on held-out folds; it is read with
``allow_pickle=False`` and scored here with numpy. The text scored is ``classify.model_input``:
what similar-incident search indexes (salient lines plus words for the structured facts), so an
offline bundle and a live collection of the same incident get the same features.

Example: ``packaged_model().rank("RuntimeError: DataLoader worker (pid 4143) is killed by signal:
Bus error. It is possible that dataloader's workers are out of shared memory.")[0]`` is
``("shm-too-small", 0.994)``.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import numpy as np
import numpy.typing as npt

MAX_TEXT = 24_000  # characters scored: the first and the last half of a longer text
CHAR_MIN, CHAR_MAX = 3, 5
_WORD = re.compile(r"\w\w+")
FloatArray = npt.NDArray[np.float64]


def model_text(text: str) -> str:
    """The text the model reads: lower case, at most MAX_TEXT characters (head and tail)."""
    if len(text) > MAX_TEXT:
        text = text[: MAX_TEXT // 2] + "\n" + text[-MAX_TEXT // 2 :]
    return text.lower()


def word_features(text: str) -> list[str]:
    """Words of two or more word characters, and each adjacent pair ("bus error")."""
    words = _WORD.findall(model_text(text))
    return words + [f"{a} {b}" for a, b in itertools.pairwise(words)]


def char_features(text: str) -> list[str]:
    """Character 3-5-grams of each whitespace-separated word padded with a space on each side
    (scikit-learn's ``char_wb``): spellings and word parts (``sm_86``, ``nvidia-smi``)."""
    out: list[str] = []
    for word in model_text(text).split():
        padded = f" {word} "
        size = len(padded)
        for n in range(CHAR_MIN, CHAR_MAX + 1):
            if size <= n:
                out.append(padded)
                continue
            out.extend(padded[i : i + n] for i in range(size - n + 1))
    return out


ANALYZERS = (word_features, char_features)  # one feature block each, normalised separately


@dataclass(frozen=True)
class Block:
    """One feature block: its vocabulary, idf weights and coefficients (features x classes)."""

    vocabulary: dict[str, int]
    idf: FloatArray
    coef: FloatArray


@dataclass(frozen=True)
class Model:
    """A trained model: classes, the feature blocks, intercepts, the calibration temperature and
    the probability at which the diagnosis lets the model speak (both chosen on held-out folds)."""

    classes: tuple[str, ...]
    blocks: tuple[Block, ...]
    intercept: FloatArray
    temperature: float = 1.0
    threshold: float = 0.9
    meta: dict[str, Any] = field(default_factory=dict)

    def probabilities(self, text: str) -> dict[str, float]:
        """Calibrated probability of each class for an evidence text (sums to 1)."""
        logits = self.intercept.astype(np.float64).copy()
        for block, analyze in zip(self.blocks, ANALYZERS, strict=True):
            known = [
                (block.vocabulary[f], 1.0 + math.log(n))  # sublinear tf
                for f, n in Counter(analyze(text)).items()
                if f in block.vocabulary
            ]
            if not known:
                continue
            idx = [i for i, _ in known]
            weights = np.array([tf for _, tf in known]) * block.idf[idx]
            norm = float(np.sqrt(weights @ weights))
            if norm > 0:
                logits += (weights / norm) @ block.coef[idx].astype(np.float64)
        scaled = logits / self.temperature
        scaled -= scaled.max()
        exp = np.exp(scaled)
        probs = exp / exp.sum()
        return {c: float(p) for c, p in zip(self.classes, probs, strict=True)}

    def weighed(self, text: str, incident: str, k: int = 4) -> list[str]:
        """The words (and word pairs) of `text` that weighed most for `incident`: what a person
        can check the model read."""
        if incident not in self.classes or not self.blocks:
            return []
        col = self.classes.index(incident)
        block = self.blocks[0]
        counts = Counter(word_features(text))
        scored = [
            ((1.0 + math.log(n)) * float(block.idf[i]) * float(block.coef[i, col]), f)
            for f, n in counts.items()
            if (i := block.vocabulary.get(f)) is not None
        ]
        return [f for w, f in sorted(scored, reverse=True)[:k] if w > 0]

    def rank(self, text: str) -> list[tuple[str, float]]:
        """Classes by probability, highest first; empty for a text with no words at all."""
        if not text.strip():
            return []
        probs = self.probabilities(text)
        return sorted(probs.items(), key=lambda kv: kv[1], reverse=True)

    @classmethod
    def from_arrays(cls, arrays: dict[str, Any]) -> Model:
        """A model from the arrays of ``model.npz`` (as scripts/build_model.py writes them)."""
        meta = json.loads(str(arrays["meta"]))
        blocks = []
        for name in ("words", "chars"):
            raw = bytes(np.asarray(arrays[f"{name}_vocabulary"], dtype=np.uint8))
            vocab = raw.decode("utf-8").split("\n") if raw else []
            blocks.append(
                Block(
                    vocabulary={v: i for i, v in enumerate(vocab)},
                    idf=np.asarray(arrays[f"{name}_idf"], dtype=np.float64),
                    coef=np.asarray(arrays[f"{name}_coef"]),
                )
            )
        return cls(
            classes=tuple(str(c) for c in arrays["classes"]),
            blocks=tuple(blocks),
            intercept=np.asarray(arrays["intercept"], dtype=np.float64),
            temperature=float(meta["temperature"]),
            threshold=float(meta["threshold"]),
            meta=meta,
        )

    @classmethod
    def packaged(cls) -> Model | None:
        return packaged_model()


@cache
def packaged_model() -> Model | None:
    """The model shipped in ``runbooks/knowledge/model.npz`` (None when it is not there)."""
    ref = resources.files("runbooks.knowledge").joinpath(MODEL_FILE)
    try:
        with ref.open("rb") as fh, np.load(fh, allow_pickle=False) as data:
            return Model.from_arrays({k: data[k] for k in data.files})
    except FileNotFoundError:
        return None


MODEL_FILE = "model.npz"


def leading(ranked: Sequence[tuple[str, float]], skip: str = "unknown") -> list[tuple[str, float]]:
    """The ranked classes without `skip` (the model's `unknown` is no candidate cause)."""
    return [(c, p) for c, p in ranked if c != skip]
