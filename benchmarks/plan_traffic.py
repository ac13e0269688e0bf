"""Bytes a compiled program writes in one run, from its optimized HLO: each instruction's output
bytes times the trip counts of the loops around it. A GPU-free proxy for memory traffic: a copy or
a zero fill that leaves the plan saves its bytes on the device too (what they cost in time the
GPU has to show).

Usage (the plan of `m3-plan --target h200`, or any program, dumped as text):
    XLA_FLAGS="--xla_dump_to=DUMP --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_step.*" \
        m3-plan --target h200 --config configs/bench-h200.yaml --mesh data=1 --devices 1
    python -m benchmarks.plan_traffic DUMP [--top 40]

Counted: every instruction of the entry computation, of while bodies (times the loop's known trip
count, nested loops multiplied) and of one branch of each conditional: `--branch false` (the
default: jax's branch 0, the false branch of `lax.cond`, which is where the MSA kernels' and the
cuDNN path's usual work sits; their other branches are fallbacks) or `true` (branch 1). A fusion
or custom call counts its output (a kernel's whole output buffer, written or not), except an
in-place dynamic-update-slice fusion, which counts its update; a fusion that wraps a custom call
(a Pallas kernel behind XLA's dynamic-slice fusion) is a "kernel"; an asynchronous fusion counts
once, at its start. Tuples, bitcasts, parameters, constants and get-tuple-element write nothing.
"""

import argparse
import collections
import glob
import os
import re
from typing import NamedTuple

from pretrain.hlo_collectives import (
    COMPUTATION,
    INSTRUCTION,
    OP_NAME,
    TRIP_COUNT,
    array_bytes,
    branches,
)

WRITES_NOTHING = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
                  "opt-barrier", "partition-id", "replica-id", "async-done"}  # fmt: skip
BRANCHES = {"false": 0, "true": 1}  # jax's branch index of a `lax.cond`'s functions


class Write(NamedTuple):
    """One instruction's bytes in a run (its output bytes times `runs`)."""

    total: int
    runs: int
    kind: str  # its opcode, or "kernel" for a fusion around a custom call
    name: str
    shape: str
    op_name: str  # the JAX op it came from (its metadata)


def computations(path: str) -> tuple[dict[str, list[str]], str]:
    """The module's computations by name (their instruction lines) and the entry's name."""
    bodies, current, entry = {}, None, None
    with open(path) as f:
        for line in f:
            if header := COMPUTATION.match(line):
                current = bodies.setdefault(header.group(1), [])
                entry = header.group(1) if line.startswith("ENTRY") else entry
            elif INSTRUCTION.match(line) and current is not None:
                current.append(line.strip())
    if entry is None:
        raise ValueError(f"{path}: no ENTRY computation")
    return bodies, entry


def _called(line: str, key: str) -> str | None:
    """The computation `line` names after `key=` (body, to_apply, calls)."""
    found = re.search(rf"\b{key}=%([\w.\-]+)", line)
    return found.group(1) if found else None


def _update_bytes(body: list[str]) -> int | None:
    """A fusion computation's update bytes where its root is a dynamic-update-slice (in place)."""
    root = next((line for line in body if line.startswith("ROOT")), "")
    update = re.search(r" dynamic-update-slice\(%[^,]+, %([^,\s)]+)", root)
    if not update:
        return None
    for line in body:
        parsed = INSTRUCTION.match(line)
        if parsed and parsed.group(1) == update.group(1):
            return array_bytes(parsed.group(2))
    return None


def writes(path: str, branch: str = "false") -> list[Write]:
    """Every counted instruction's bytes in one run of the module in `path` (module docstring)."""
    bodies, entry = computations(path)
    found, pending = [], [(entry, 1)]
    while pending:
        name, runs = pending.pop()
        for line in bodies[name]:
            label, shape, kind, _ = INSTRUCTION.match(line).groups()
            if kind == "while":
                trips = TRIP_COUNT.search(line)
                pending.append((_called(line, "body"), runs * (int(trips[1]) if trips else 1)))
                continue
            if kind == "conditional":
                pending.append((branches(line)[BRANCHES[branch]], runs))
                continue
            if kind == "call":
                pending.append((_called(line, "to_apply"), runs))
                continue
            if kind in WRITES_NOTHING:
                continue
            if kind == "async-start":  # an asynchronous fusion: count the fusion it wraps
                inner = bodies.get(_called(line, "calls"), [])
                line = next((x for x in inner if " fusion(" in x), None)
                if line is None:
                    continue
                _, shape, kind, _ = INSTRUCTION.match(line).groups()
            size = array_bytes(shape)
            if kind == "fusion":
                fused = bodies.get(_called(line, "calls"), [])
                if any(" custom-call(" in x for x in fused):
                    kind = "kernel"
                update = _update_bytes(fused)
                size = size if update is None else update
            op_name = OP_NAME.search(line)
            found.append(Write(size * runs, runs, kind, label, shape,
                               op_name.group(1) if op_name else ""))  # fmt: skip
    return found


def optimized_module(dump: str) -> str:
    """The largest optimized-HLO text file in an XLA dump directory (the step's module)."""
    paths = glob.glob(os.path.join(dump, "*after_optimizations.txt"))
    if not paths:
        raise FileNotFoundError(f"no *after_optimizations.txt in {dump} (XLA_FLAGS: "
                                "--xla_dump_to=DIR --xla_dump_hlo_as_text)")  # fmt: skip
    return max(paths, key=os.path.getsize)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dump", help="an XLA dump directory (or one optimized HLO text file)")
    parser.add_argument("--top", type=int, default=40, help="instructions listed")
    parser.add_argument("--branch", choices=["false", "true"], default="false")
    args = parser.parse_args()
    path = args.dump if os.path.isfile(args.dump) else optimized_module(args.dump)
    found = writes(path, args.branch)
    by_kind = collections.Counter()
    for write in found:
        by_kind[write.kind] += write.total
    print(f"{path}\nwritten in one run: {sum(by_kind.values()) / 1e9:.1f} GB; by kind (GB): "
          + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in by_kind.most_common()))  # fmt: skip
    for write in sorted(found, reverse=True)[: args.top]:
        print(f"{write.total / 1e9:8.2f} GB x{write.runs:<4} {write.kind:11} {write.name[:32]:32} "
              f"{write.shape[:70]} | {write.op_name[-90:]}")  # fmt: skip


if __name__ == "__main__":
    main()
