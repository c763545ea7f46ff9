"""Verifiable tasks: prompts with checkable answers.

The built-in tasks are multi-digit arithmetic and digit strings to sort or reverse (the
staleness test bed's task, with answers long enough for sequence-level ratios to matter),
small enough that a tiny MoE learns them on a CPU in minutes and exact enough that the
reward is unambiguous. Real runs load
GSM8K/MATH-style JSONL files from disk (see :func:`load_jsonl_examples`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import zlib
from collections.abc import Sequence

import numpy as np

SPLITS = ("train", "test")


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt with its reference answer."""

    prompt_id: str
    prompt: str
    answer: str


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    """``a+b=`` with operands of ``min_digits..max_digits`` digits; the answer is the sum.

    Every example is a pure function of ``(seed, split, index)``: no state, so a data
    iterator checkpoint is just an index. The test split uses a disjoint random stream;
    collisions with train are possible for tiny digit counts and are harmless for a
    smoke-scale evaluation.
    """

    min_digits: int = 1
    max_digits: int = 2
    ops: tuple[str, ...] = ("+",)
    seed: int = 0
    size: int = 100_000

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"min_digits/max_digits: need 1 <= min_digits <= max_digits, got "
                f"{self.min_digits}/{self.max_digits}"
            )
        unknown = set(self.ops) - {"+", "-", "*"}
        if not self.ops or unknown:
            raise ValueError(f"ops: must be a non-empty subset of '+-*', got {self.ops!r}")

    def example(self, index: int, split: str = "train") -> Example:
        if split not in SPLITS:
            raise ValueError(f"split: must be one of {SPLITS}, got {split!r}")
        rng = np.random.default_rng((self.seed, SPLITS.index(split), int(index)))
        da, db = rng.integers(self.min_digits, self.max_digits + 1, size=2)
        a = int(rng.integers(0 if da == 1 else 10 ** (da - 1), 10**da))
        b = int(rng.integers(0 if db == 1 else 10 ** (db - 1), 10**db))
        op = self.ops[int(rng.integers(len(self.ops)))]
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Example(prompt_id=f"{split}-{index}", prompt=f"{a}{op}{b}=", answer=str(value))

    def reward(self, response: str, example: Example) -> float:
        return exact_match_reward(response, example.answer)


DIGIT_STRING_OPS = ("sort", "reverse")
SCORINGS = ("exact", "per_position")


@dataclasses.dataclass(frozen=True)
class DigitStringTask:
    """``sort:<digits>=`` or ``reverse:<digits>=``: a string of ``min_digits..max_digits``
    random decimal digits; the answer is the string sorted ascending or reversed.

    The answer is as long as the input, so a 6-digit task has 7-token responses (with EOS):
    long enough for GSPO's sequence ratio (the geometric mean of the token ratios) to
    differ from any one token's ratio, unlike 1-digit arithmetic's 2-3 tokens.

    ``scoring="exact"`` scores 1 for the whole string right, else 0; ``"per_position"``
    scores the fraction of positions right (:func:`per_position_reward`), a denser signal
    that a small policy can climb one digit at a time. Examples are pure functions of
    ``(seed, split, index)``, as :class:`ArithmeticTask`'s.
    """

    op: str = "sort"
    min_digits: int = 6
    max_digits: int = 6
    scoring: str = "exact"
    seed: int = 0
    size: int = 100_000

    def __post_init__(self) -> None:
        if self.op not in DIGIT_STRING_OPS:
            raise ValueError(f"op: must be one of {DIGIT_STRING_OPS}, got {self.op!r}")
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"min_digits/max_digits: need 1 <= min_digits <= max_digits, got "
                f"{self.min_digits}/{self.max_digits}"
            )
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring: must be one of {SCORINGS}, "
                             f"got {self.scoring!r}")

    def example(self, index: int, split: str = "train") -> Example:
        if split not in SPLITS:
            raise ValueError(f"split: must be one of {SPLITS}, got {split!r}")
        rng = np.random.default_rng((self.seed, SPLITS.index(split), int(index)))
        n = int(rng.integers(self.min_digits, self.max_digits + 1))
        digits = "".join(str(int(d)) for d in rng.integers(0, 10, size=n))
        answer = "".join(sorted(digits)) if self.op == "sort" else digits[::-1]
        return Example(prompt_id=f"{split}-{index}", prompt=f"{self.op}:{digits}=",
                       answer=answer)

    def reward(self, response: str, example: Example) -> float:
        if self.scoring == "exact":
            return exact_match_reward(response, example.answer)
        return per_position_reward(response, example.answer)


def per_position_reward(response: str, answer: str) -> float:
    """Fraction of positions where the response (first line, stripped) matches ``answer``.

    ``sum_i [response_i == answer_i] / max(len(response), len(answer))``: a missing or an
    extra character costs one position each, so only the exact answer scores 1.0.
    """
    got, want = response.split("\n", 1)[0].strip(), answer.strip()
    n = max(len(got), len(want))
    if n == 0:
        return 1.0
    return sum(a == b for a, b in zip(got, want, strict=False)) / n


def exact_match_reward(response: str, answer: str) -> float:
    """1.0 when the response, up to its first newline and stripped, equals ``answer``."""
    first_line = response.split("\n", 1)[0].strip()
    return 1.0 if first_line == answer.strip() else 0.0


_GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.S)


def _reference_answer(raw: str) -> str:
    """GSM8K puts the final answer after ``####``; MATH-style files store it directly."""
    m = _GSM8K_ANSWER.search(raw)
    return (m.group(1) if m else raw).strip().replace(",", "")


def load_jsonl_examples(
    path: str | os.PathLike[str],
    *,
    question_key: str = "question",
    answer_key: str = "answer",
) -> list[Example]:
    """Reads a GSM8K/MATH-style JSONL file (one ``{"question": ..., "answer": ...}`` a line).

    Prompt ids are a hash of the question so they survive reordering of the file.
    """
    examples = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            for key in (question_key, answer_key):
                if key not in row:
                    raise ValueError(f"{path}:{lineno}: missing key {key!r}")
            question = str(row[question_key])
            examples.append(
                Example(
                    prompt_id=f"q{zlib.crc32(question.encode()):08x}",
                    prompt=question,
                    answer=_reference_answer(str(row[answer_key])),
                )
            )
    if not examples:
        raise ValueError(f"{path}: no examples")
    return examples


def math_answer_reward(response: str, answer: str) -> float:
    """1.0 when ``math_verify`` judges the response's final answer equal to ``answer``."""
    try:
        from math_verify import parse, verify
    except ImportError as e:  # optional dependency: pip install 'satjax[math]'
        raise ImportError("math_answer_reward needs math-verify: pip install 'satjax[math]'") from e
    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    pred = parse(response)
    return 1.0 if gold and pred and verify(gold, pred) else 0.0


@dataclasses.dataclass(frozen=True)
class JsonlMathTask:
    """A task over a list of on-disk examples with the math-verify reward."""

    examples: Sequence[Example]
    test_fraction: float = 0.1

    @property
    def size(self) -> int:
        return len(self.examples)

    def _split_indices(self, split: str) -> list[int]:
        n_test = max(1, int(len(self.examples) * self.test_fraction))
        if split == "test":
            return list(range(n_test))
        if split == "train":
            return list(range(n_test, len(self.examples))) or list(range(len(self.examples)))
        raise ValueError(f"split: must be one of {SPLITS}, got {split!r}")

    def example(self, index: int, split: str = "train") -> Example:
        idx = self._split_indices(split)
        return self.examples[idx[int(index) % len(idx)]]

    def reward(self, response: str, example: Example) -> float:
        return math_answer_reward(response, example.answer)
