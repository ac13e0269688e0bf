"""The plan traffic counter on a compiled program whose writes are known: a loop of five trips that
stacks its carry, then a conditional."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import plan_traffic

ROW = 1000 * 4  # bytes of the f32[1000] carry


@pytest.fixture(scope="module")
def optimized_hlo(tmp_path_factory):
    def program(x):
        def body(carry, _):
            carry = jnp.sin(carry) * 2.0
            return carry, carry  # the carry, and the same row into a [5, 1000] stack

        carry, stack = jax.lax.scan(body, x, None, length=5)
        return jax.lax.cond(carry[0] > 0, lambda: stack * 3.0, lambda: jnp.exp(stack) + 1.0)

    path = tmp_path_factory.mktemp("hlo") / "module.sm_after_optimizations.txt"
    path.write_text(jax.jit(program).lower(jnp.ones(1000)).compile().as_text())
    return str(path)


def test_loop_writes_count_once_a_trip_and_a_stack_update_by_its_row(optimized_hlo):
    writes = plan_traffic.writes(optimized_hlo)
    in_loop = [w for w in writes if w.runs == 5 and w.kind == "fusion" and "f32[" in w.shape]
    assert in_loop, writes
    # the sine-times-two row and its dynamic-update-slice into the stack: one row a trip each
    assert all(w.total == 5 * ROW for w in in_loop), in_loop
    assert any("[5,1000]" in w.shape for w in in_loop)  # counted by its update, not its buffer
    # the stack's fill before the loop: written once, whole
    assert any(w.runs == 1 and "[5,1000]" in w.shape and w.total == 5 * ROW for w in writes)


def test_one_branch_of_a_conditional_is_counted(optimized_hlo):
    taken = {w.op_name for w in plan_traffic.writes(optimized_hlo, "false")}
    other = {w.op_name for w in plan_traffic.writes(optimized_hlo, "true")}
    assert any("branch_0" in name for name in taken)
    assert not any("branch_1" in name for name in taken)
    assert any("branch_1" in name for name in other)


def test_the_dump_s_largest_optimized_module_is_read(tmp_path, optimized_hlo):
    (tmp_path / "small.after_optimizations.txt").write_text("ENTRY %e () -> f32[] {\n}\n")
    (tmp_path / "big.after_optimizations.txt").write_text(open(optimized_hlo).read())
    assert plan_traffic.optimized_module(str(tmp_path)).endswith("big.after_optimizations.txt")
    with pytest.raises(FileNotFoundError):
        plan_traffic.optimized_module(str(tmp_path / "nothing"))
