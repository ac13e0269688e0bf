"""The sizes of the values a jaxpr computes, for tests that bound a program's memory by its shapes
(no compile, no allocation)."""


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
