"""What a program holds, read from its jaxpr (no compile, no allocation): the sizes of its values,
for tests that bound its memory, its Pallas kernel launches and its primitives."""

import collections

from jax.extend import core as jcore


def value_sizes(jaxpr, path: str = "") -> dict[str, tuple[int, str]]:
    """Bytes and type of every value an equation produces, sub-jaxprs included, keyed by place."""
    sizes = {}
    for i, eqn in enumerate(jaxpr.eqns):
        key = f"{path}/{i}:{eqn.primitive.name}"
        for j, var in enumerate(eqn.outvars):
            if hasattr(var.aval, "shape"):
                sizes[f"{key}#{j}"] = (var.aval.size * var.aval.dtype.itemsize, str(var.aval))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    sizes.update(value_sizes(inner, key))
    return sizes


def kernel_calls(jaxpr: jcore.Jaxpr) -> collections.Counter:
    """How many times each Pallas kernel (by name) appears in a program, sub-programs included."""
    return _calls(jaxpr, lambda eqn: eqn.params["name"] if eqn.primitive.name == "pallas_call"
                  else None)  # fmt: skip


def primitive_calls(jaxpr: jcore.Jaxpr) -> collections.Counter:
    """How many times each primitive (by name) appears in a program, sub-programs included."""
    return _calls(jaxpr, lambda eqn: eqn.primitive.name)


def scan_lengths(jaxpr: jcore.Jaxpr) -> collections.Counter:
    """How many `lax.scan` loops of each length a program holds, sub-programs included."""
    return _calls(jaxpr, lambda eqn: eqn.params["length"] if eqn.primitive.name == "scan" else None)


def _calls(jaxpr: jcore.Jaxpr, key) -> collections.Counter:
    counts = collections.Counter()
    for eqn in jaxpr.eqns:
        if (name := key(eqn)) is not None:
            counts[name] += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if isinstance(sub, jcore.ClosedJaxpr | jcore.Jaxpr):
                    inner = sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub
                    counts += _calls(inner, key)
    return counts
