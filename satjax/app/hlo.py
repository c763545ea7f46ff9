"""What a compiled program communicates, read from its optimised HLO text.

``jax.jit(f).lower(...).compile().as_text()`` is the SPMD-partitioned module one device
runs: each collective's shapes are that device's. :func:`collectives` counts every
collective op (``all-gather``, ``all-reduce``, ``reduce-scatter``, ``all-to-all``,
``ragged-all-to-all``, ``collective-permute``, ``collective-broadcast``, synchronous or as
an async ``-start``) the number of times it runs per call of the program: an op inside a
``while`` body runs once per iteration, and XLA's own ``cost_analysis()`` counts a loop
body once. A loop's trip count is XLA's ``known_trip_count`` annotation where the compiler
writes one (XLA:CPU, XLA:GPU), else read from its condition when that is JAX's counted-loop
form (``counter < N``: ``lax.scan``, ``fori_loop``, ``lax.map``; how libtpu leaves it); any
other loop (data-dependent bounds) counts once and is reported in
``CollectiveStats.unknown_loops``.

Bytes are per device: the op's whole buffer (all-gather's output, reduce-scatter's input,
all-reduce's, all-to-all's and a permute's result; for a ragged all-to-all, whose output is
sized for the worst case, 1/n of it: what balanced routing sends), and ``traffic`` what a
ring algorithm sends per device for it (``(n-1)/n`` of the buffer, twice for an all-reduce;
a permute sends its buffer once), with ``n`` the op's replica-group size.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

# bytes per element of each HLO element type (sub-byte types rounded up to a byte)
_ELEMENT_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
                  "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
                  "c64": 8, "c128": 16}
KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
         "collective-permute", "collective-broadcast")
_OP = re.compile(r"^\s*(?:ROOT )?%\S+ = (.*?) (" + "|".join(sorted(KINDS, key=len, reverse=True))
                 + r")(-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{\s*$")
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply)=%([^\s,)]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')  # XLA:CPU/GPU annotate it
_COUNTED = re.compile(r"ROOT %\S+ = pred\[\]\S* compare\(%get-tuple-element[^,]*, "
                      r"%(\S+?)\), direction=LT")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One kind of collective over one program call, per device."""

    kind: str
    count: int    # executions per call of the program
    bytes: int    # buffer bytes, summed over executions
    traffic: int  # bytes a ring algorithm sends, summed over executions


@dataclasses.dataclass(frozen=True)
class CollectiveStats:
    by_kind: tuple[Collective, ...]
    unknown_loops: int  # while loops whose trip count is not static (counted once)

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.by_kind)

    @property
    def traffic(self) -> int:
        return sum(c.traffic for c in self.by_kind)


def _array_bytes(text: str) -> list[int]:
    out = []
    for dtype, dims in _ARRAY.findall(text):
        size = _ELEMENT_BYTES.get(dtype, 1)  # fp8 variants and the like: one byte
        out.append(size * math.prod(int(d) for d in dims.split(",") if d))
    return out


def _group_size(line: str, num_devices: int) -> int:
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", line)  # iota: [groups, size]
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", m.group(2)))
    return num_devices  # replica_groups={} or absent: every device


def _buffer(kind: str, start: bool, result_type: str, group: int) -> int:
    arrays = _array_bytes(result_type)
    if not arrays:
        return 0
    if start and kind in ("all-gather", "collective-permute", "ragged-all-to-all"):
        # async start's result is (operands..., outputs..., contexts): the output is the
        # largest array for a gather; a permute's input and output are the same size
        total = max(arrays)
    else:
        total = sum(arrays)
    if kind == "reduce-scatter":
        return total * group
    if kind == "ragged-all-to-all":
        # its output is sized for the worst case, every row from every peer; what moves
        # depends on the data: count the rows of balanced routing, 1/n of that buffer
        return total // group
    return total


def _traffic(kind: str, buffer: int, group: int) -> int:
    if kind == "collective-permute":
        return buffer
    share = buffer * (group - 1) // max(group, 1)
    return 2 * share if kind == "all-reduce" else share


def collectives(hlo_text: str, num_devices: int) -> CollectiveStats:
    """The collectives of an optimised HLO module (``Compiled.as_text()``) per device and
    per call, loop iterations included (module docstring). ``num_devices``: the
    program's device count (the group of an op without replica groups)."""
    comps: dict[str, list[str]] = {}
    entry = None
    current: list[str] | None = None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = comps.setdefault(m.group(1), [])
            if line.startswith("ENTRY"):
                entry = m.group(1)
        elif line.rstrip() == "}":  # not "}}, ...": a custom call's config spans lines
            current = None
        elif current is not None:
            current.append(line)
    if entry is None:
        raise ValueError("not an HLO module: no ENTRY computation")

    def trip_count(condition: str) -> int | None:
        lines = comps.get(condition, [])
        for line in lines:
            m = _COUNTED.search(line)
            if m:
                const = re.compile(rf"%{re.escape(m.group(1))} = s\d+\[\]\S* constant\((\d+)\)")
                for other in lines:
                    c = const.search(other)
                    if c:
                        return int(c.group(1))
        return None

    # how many times each computation runs per call of the entry
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)  # callee -> (caller, factor)
    unknown = 0
    for name, lines in comps.items():
        for line in lines:
            callees = dict(_CALLEE.findall(line))
            factor = 1
            if "body" in callees:
                known = _KNOWN_TRIPS.search(line)
                n = int(known.group(1)) if known else trip_count(callees.get("condition", ""))
                if n is None:
                    unknown += 1
                factor = 1 if n is None else n
                calls[callees["body"]].append((name, factor))
            for key in ("calls", "to_apply"):
                if key in callees:
                    calls[callees[key]].append((name, 1))
            for branches in _BRANCHES.findall(line):
                for b in re.findall(r"%([^\s,]+)", branches):
                    calls[b].append((name, 1))
    memo: dict[str, int] = {entry: 1}

    def runs(comp: str) -> int:
        if comp not in memo:
            memo[comp] = 0  # a cycle cannot occur in HLO; guards a malformed module
            memo[comp] = sum(runs(caller) * factor for caller, factor in calls.get(comp, ()))
        return memo[comp]

    totals: dict[str, list[int]] = {k: [0, 0, 0] for k in KINDS}
    for name, lines in comps.items():
        times = runs(name)
        if not times:
            continue
        for line in lines:
            m = _OP.match(line)
            if not m:
                continue
            result_type, kind, start = m.group(1), m.group(2), bool(m.group(3))
            group = _group_size(line, num_devices)
            buffer = _buffer(kind, start, result_type, group)
            t = totals[kind]
            t[0] += times
            t[1] += times * buffer
            t[2] += times * _traffic(kind, buffer, group)
    return CollectiveStats(
        by_kind=tuple(Collective(k, *v) for k, v in totals.items() if v[0]),
        unknown_loops=unknown)
