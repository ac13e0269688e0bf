"""Bytes moved by the collectives of a compiled (SPMD-partitioned) XLA program, from its HLO text.

Each collective counts the size of its full (unsharded) side on one device: the result of an
all-gather, all-reduce, all-to-all or collective-permute, the operand of a reduce-scatter. Work in
a `while` counts its known trip count times (layer scans); of a `conditional`'s branches the
cheapest counts, since one runs per call and the expert-parallel exchange's worst-case branch is the
rare one (m3jax/moe/padded.py). XLA:GPU's asynchronous pairs (`all-to-all-start` ...
`all-to-all-done`) count once, at the done. These are bytes per device per step, not wire
traffic: a ring all-gather of B bytes over n devices sends (n - 1)/n · B from each.
"""

import collections
import re

import numpy as np

COLLECTIVES = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)
_OPERAND_SIDE = ("reduce-scatter",)

# the HLO text's pieces, also read by benchmarks/plan_traffic.py
COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
_NAME = re.compile(r"%([\w.\-]+)")
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|f8e\w+)\[([\d,]*)\]")
_CALLED = re.compile(r"\b(?:body|to_apply|calls)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}|true_computation=%([\w.\-]+), "
                       r"false_computation=%([\w.\-]+)")  # fmt: skip
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[\d+,(\d+)\]<=")
_LISTED_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")
OP_NAME = re.compile(r'op_name="([^"]*)"')
TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """{collective op: bytes per device per run of the program's ENTRY computation}."""
    counts = collections.Counter()
    for op, size, _ in contributions(hlo_text):
        counts[op] += size
    return dict(counts)


def contributions(hlo_text: str) -> list[tuple[str, int, str]]:
    """(op, bytes per run, "shape  jax op name") of every collective, loop trips included."""
    computations, entry = _parse(hlo_text)
    return _walk(computations, entry, 1)


def _walk(computations: dict, name: str, trips: int) -> list[tuple[str, int, str]]:
    """The collectives of `trips` runs of computation `name`, and of what it calls (of a
    conditional, the branch moving the fewest bytes, its own loops' trips included)."""
    found = []
    for op, size, label, called, branches, inner_trips in computations.get(name, ()):
        if op in COLLECTIVES:
            found.append((op, size * trips, label))
        for callee in called:
            found += _walk(computations, callee, trips * inner_trips)
        if branches:
            taken = (_walk(computations, branch, trips) for branch in branches)
            found += min(taken, key=lambda items: sum(item[1] for item in items))
    return found


def _parse(hlo_text: str):
    """{computation: [(op, bytes, called computations, conditional branches, trip count)]}."""
    computations, entry, current, sizes = {}, None, None, {}
    started = {}  # async collectives' start -> operand bytes (None: over size-1 axes)
    for line in hlo_text.splitlines():
        header = COMPUTATION.match(line)
        if header:
            current = computations.setdefault(header.group(1), [])
            entry = header.group(1) if line.startswith("ENTRY") else entry
            continue
        instruction = INSTRUCTION.match(line)
        if current is None or not instruction:
            continue
        name, result, op, rest = instruction.groups()
        sizes[name] = array_bytes(result)
        operands = _NAME.findall(rest.split(")", 1)[0])
        operand_bytes = sum(sizes.get(operand, 0) for operand in operands)
        if op.endswith("-start") and op.removesuffix("-start") in COLLECTIVES:
            # XLA:GPU's async pair: the start holds the groups and operands, the done the result
            started[name] = None if _group_size(line) == 1 else operand_bytes
            continue
        if op.endswith("-done") and op.removesuffix("-done") in COLLECTIVES:
            op, start_operand_bytes = op.removesuffix("-done"), started.get(operands[0])
            if start_operand_bytes is None:
                continue
            size = start_operand_bytes if op in _OPERAND_SIDE else sizes[name]
        elif op in COLLECTIVES and _group_size(line) == 1:
            continue  # over size-1 mesh axes only: moves nothing
        elif op in _OPERAND_SIDE:  # operands are named, their types are where they are defined
            size = operand_bytes
        else:
            size = sizes[name]
        trips = TRIP_COUNT.search(line)
        where = OP_NAME.search(line)
        label = f"{result.split('{')[0]}  {where[1][-100:] if where else ''}"
        trips = int(trips[1]) if trips else 1
        current.append((op, size, label, _CALLED.findall(line), branches(line), trips))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def _group_size(line: str) -> int | None:
    """Devices per replica group of a collective (None where the text does not say)."""
    if found := _MESH_GROUPS.search(line):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", found.group(1)))
        return int(np.prod([int(sizes[a]) for a in re.findall(r"'(\w+)'", found.group(2))]))
    if found := _IOTA_GROUPS.search(line):
        return int(found.group(1))
    if found := _LISTED_GROUPS.search(line):
        return len(found.group(1).split(","))
    return None


def branches(line: str) -> list[str]:
    """A conditional's branch computations in branch-index order (a predicate's: false, true;
    jax's `lax.cond` puts its false function at index 0); [] for any other instruction."""
    found = _BRANCHES.search(line)
    if not found:
        return []
    if found.group(1) is not None:
        return [name.strip().lstrip("%") for name in found.group(1).split(",")]
    return [found.group(3), found.group(2)]


def array_bytes(types: str) -> int:
    """Bytes of every array type in `types` (a tuple's elements summed)."""
    total = 0
    for dtype, dims in _ARRAY.findall(types):
        itemsize = 1 if dtype == "pred" else _itemsize(dtype)
        total += itemsize * int(np.prod([int(d) for d in dims.split(",") if d]))
    return total


def _itemsize(dtype: str) -> int:
    if dtype == "bf16":
        return 2
    if dtype.startswith("f8"):
        return 1
    return int(dtype[1:]) // 8


def largest(hlo_text: str, count: int = 10) -> list[str]:
    """The `count` largest collectives: "op GB shape  jax op name" (where the bytes go)."""
    ranked = sorted(contributions(hlo_text), key=lambda c: -c[1])[:count]
    return [f"{op} {size / 1e9:.4g} GB {label}" for op, size, label in ranked]


def summary(counts: dict[str, int]) -> str:
    """One line: op name and GB, largest first."""
    parts = [f"{op} {size / 1e9:.4g}" for op, size in sorted(counts.items(), key=lambda x: -x[1])]
    return ", ".join(parts) or "none"
