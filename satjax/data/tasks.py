"""Verifiable tasks: prompts with checkable answers.

The built-in tasks are multi-digit arithmetic and digit strings to sort or reverse (the
staleness test bed's task, with answers long enough for sequence-level ratios to matter),
small enough that a tiny MoE learns them on a CPU in minutes and exact enough that the
reward is unambiguous. Real runs load
GSM8K/MATH-style rows from JSONL, Parquet or a ``datasets`` directory
(:func:`load_examples`) into a :class:`FileTask`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

SPLITS = ("train", "test")


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt with its reference answer."""

    prompt_id: str
    prompt: str
    answer: str
    index: int = -1  # the row's position in its file (file tasks)
    # the row as read (file tasks): what prompt templates and reward functions may use
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)


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
    that a small policy can climb one digit at a time. A ``separator`` (e.g. ``","``) is
    written between the digits of prompt and answer, ``sort:3,1,2=`` -> ``1,2,3``: 16
    digits make a 31-character answer (32 tokens with EOS), long enough for the sequence
    ratio to average many tokens; per-position scoring then counts digits, not separators.
    Examples are pure functions of ``(seed, split, index)``, as :class:`ArithmeticTask`'s.
    """

    op: str = "sort"
    min_digits: int = 6
    max_digits: int = 6
    scoring: str = "exact"
    separator: str = ""
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
        if any(c.isdigit() or c in "=\n" for c in self.separator):
            raise ValueError(f"separator: must not hold a digit, '=' or a newline, "
                             f"got {self.separator!r}")

    def example(self, index: int, split: str = "train") -> Example:
        if split not in SPLITS:
            raise ValueError(f"split: must be one of {SPLITS}, got {split!r}")
        rng = np.random.default_rng((self.seed, SPLITS.index(split), int(index)))
        n = int(rng.integers(self.min_digits, self.max_digits + 1))
        digits = [str(int(d)) for d in rng.integers(0, 10, size=n)]
        answer = sorted(digits) if self.op == "sort" else digits[::-1]
        sep = self.separator
        return Example(prompt_id=f"{split}-{index}", prompt=f"{self.op}:{sep.join(digits)}=",
                       answer=sep.join(answer))

    def reward(self, response: str, example: Example) -> float:
        if self.scoring == "exact":
            return exact_match_reward(response, example.answer)
        return per_position_reward(response, example.answer, self.separator)


def per_position_reward(response: str, answer: str, separator: str = "") -> float:
    """Fraction of positions where the response (first line, stripped) matches ``answer``.

    ``sum_i [response_i == answer_i] / max(len(response), len(answer))``: a missing or an
    extra item costs one position each, so only the exact answer scores 1.0. The items are
    characters, or with a ``separator`` the pieces between separators (the digits).
    """
    got_text, want_text = response.split("\n", 1)[0].strip(), answer.strip()
    got: Sequence[str] = got_text
    want: Sequence[str] = want_text
    if separator:
        got, want = got_text.split(separator) if got_text else [], want_text.split(separator)
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


def data_format(path: str | os.PathLike[str]) -> str:
    """"datasets" (a ``Dataset.save_to_disk`` directory), "parquet" (by its magic bytes,
    whatever the file is called) or "jsonl"."""
    if os.path.isdir(path):
        return "datasets"
    with open(path, "rb") as f:
        return "parquet" if f.read(4) == b"PAR1" else "jsonl"


def _utf8_lines(f, path) -> Iterator[str]:
    try:
        yield from f
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text; give a JSONL or Parquet file or a "
                         "datasets directory") from None


def _load_dataset(path: str | os.PathLike[str]):
    """A ``save_to_disk`` directory's ``Dataset`` (of a ``DatasetDict``: its "train")."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"{path}: reading a datasets directory needs datasets: "
                          "pip install 'satjax[data]'") from e
    try:
        ds = datasets.load_from_disk(os.fspath(path))
    except FileNotFoundError as e:
        raise ValueError(f"{path}: not a directory saved with save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"{path}: a DatasetDict without a 'train' split "
                             f"({', '.join(ds)}); point at one split's directory")
        ds = ds["train"]
    return ds


def load_rows(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of a JSONL file, a Parquet file or a ``datasets`` directory saved with
    ``save_to_disk`` (a ``DatasetDict`` directory: its "train" split), as dicts.

    Raises ValueError (one line: the path, the row, what is wrong) for unreadable rows, and
    ImportError naming the extra to install for Parquet (``pyarrow``) or ``datasets``."""
    fmt = data_format(path)
    if fmt == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(f"{path}: reading Parquet needs pyarrow: "
                              "pip install 'satjax[data]'") from e
        return pq.read_table(path).to_pylist()
    if fmt == "datasets":
        return [dict(r) for r in _load_dataset(path)]
    rows = []
    with open(path, encoding="utf-8") as f:
        lines = list(_utf8_lines(f, path))
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            rows.append(_json_row(line, path, lineno))
    return rows


def _json_row(line: str, path: str | os.PathLike[str], lineno: int) -> dict[str, Any]:
    """One JSONL line as a row; ValueError naming ``path:lineno`` if it is not an object."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{lineno}: must be a JSON object, got {type(row).__name__}")
    return row


def first_row(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The first row of ``path`` (for a Parquet file or a datasets directory: its field
    names, with empty values), read without loading the rest: how a run checks its field
    names before anything slow. Raises ValueError as :func:`load_rows` does."""
    fmt = data_format(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return dict.fromkeys(pq.ParquetFile(path).schema_arrow.names, "")
    if fmt == "datasets":
        return dict.fromkeys(_load_dataset(path).column_names, "")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(_utf8_lines(f, path), 1):
            if line.strip():
                return _json_row(line, path, lineno)
    raise ValueError(f"{path}: no examples")


def load_examples(
    path: str | os.PathLike[str],
    *,
    question_field: str = "question",
    answer_field: str = "answer",
) -> list[Example]:
    """The rows of ``path`` (:func:`load_rows`) as examples: ``question_field`` is the
    prompt, ``answer_field`` the reference answer (after GSM8K's ``####`` if there is
    one); the whole row is kept in ``Example.fields`` for prompt templates and reward
    functions, and its position in ``Example.index``. A row without either, or with it
    null, is refused (ValueError naming the row).

    Prompt ids are a hash of the question so they survive reordering of the file.
    """
    examples = []
    for i, row in enumerate(load_rows(path)):
        for field, key in ((question_field, "task.question_field"),
                           (answer_field, "task.answer_field")):
            if field not in row:
                raise ValueError(f"{path}: row {i} has no field {field!r} (its fields: "
                                 f"{', '.join(map(str, row))}); set {key}")
            # JSON null, or a Parquet/datasets row without it (a column holds every
            # field): str() would make it the text "None", trained and scored as such
            if row[field] is None:
                raise ValueError(f"{path}: row {i}: its {field!r} ({key}) is null; give "
                                 "every row one, or leave the row out")
        question = str(row[question_field])
        examples.append(Example(
            prompt_id=f"q{zlib.crc32(question.encode()):08x}", prompt=question,
            answer=_reference_answer(str(row[answer_field])), index=i, fields=row))
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


RewardFn = Callable[[str, Example], float]


@dataclasses.dataclass(frozen=True)
class FileTask:
    """A task over examples loaded from disk (:func:`load_examples`), scored by ``reward_fn``.

    The held-out split is ``eval_examples`` when given (a separate file, used whole),
    else the first ``test_fraction`` of ``examples``; training uses the rest.
    """

    examples: Sequence[Example]
    reward_fn: RewardFn
    eval_examples: Sequence[Example] | None = None
    test_fraction: float = 0.1

    @property
    def _n_test(self) -> int:
        return 0 if self.eval_examples is not None else \
            max(1, int(len(self.examples) * self.test_fraction))

    @property
    def size(self) -> int:
        """Training examples."""
        return len(self.examples) - self._n_test or len(self.examples)

    @property
    def test_size(self) -> int:
        """Held-out examples."""
        return len(self.eval_examples) if self.eval_examples is not None else self._n_test

    def example(self, index: int, split: str = "train") -> Example:
        if split == "test":
            held = self.eval_examples if self.eval_examples is not None else \
                self.examples[:self._n_test]
            return held[int(index) % len(held)]
        if split == "train":
            train = self.examples[self._n_test:] or self.examples
            return train[int(index) % len(train)]
        raise ValueError(f"split: must be one of {SPLITS}, got {split!r}")

    def reward(self, response: str, example: Example) -> float:
        return self.reward_fn(response, example)


@dataclasses.dataclass(frozen=True)
class RescoredTask:
    """A built-in task scored by ``reward_fn`` instead of its own reward (``task.reward``)."""

    task: ArithmeticTask | DigitStringTask
    reward_fn: RewardFn

    @property
    def size(self) -> int:
        return self.task.size

    def example(self, index: int, split: str = "train") -> Example:
        return self.task.example(index, split)

    def reward(self, response: str, example: Example) -> float:
        return self.reward_fn(response, example)
