"""Expert parallelism: the MoE block sharded over the `expert` mesh axis equals the one-device block.

Outputs, gradients (router, experts, shared expert, input) and router statistics, float32, with
uneven loads and an idle expert (moe_cases.skewed_bias). With 8 experts over 8 devices the last
device owns only the idle expert and receives no rows. The suite runs on 4 fake devices
(conftest.py); the 8-device cases run again in a subprocess with 8
(`test_expert_parallel_on_8_devices`). On CPU the ragged exchange runs through the all_gather
emulation of `ragged_all_to_all` (XLA:CPU has no ragged-all-to-all); the emulation is checked
against the example in jax's own documentation.
"""

import functools
import itertools
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO
from flax import nnx
from jax.sharding import PartitionSpec
from moe_cases import B, S, assert_trees_close, inputs, moe_config, random_state, run

from m3jax import sharding
from m3jax.moe import expert_parallel, padded, ragged
from m3jax.moe.layer import MoE
from m3jax.moe.local import EXPERT_WEIGHT_AXES

MESHES = {
    "ep2": {"expert": 2},
    "ep4": {"expert": 4},
    "ep8": {"expert": 8},
    "ep2-data2": {"data": 2, "expert": 2},
    "ep2-fsdp2": {"fsdp": 2, "expert": 2},
    "ep2-seq2": {"expert": 2, "seq": 2},
    "ep2-tensor2": {"expert": 2, "tensor": 2},
}
NO_DROPS = 4.0  # capacity factor with C = ⌈4 · N·2 / 8⌉ = N on every device: nothing drops


# Meshes this process can build: the main run has 4 fake devices, so the 8-device cases are not
# collected here; test_expert_parallel_on_8_devices runs them in a subprocess with 8.
RUNNABLE = [
    name for name, sizes in MESHES.items() if math.prod(sizes.values()) <= jax.device_count()
]


def mesh_of(name: str):
    sizes = MESHES[name]
    return sharding.make_mesh(sizes, devices=jax.devices()[: math.prod(sizes.values())])


@functools.cache
def one_device(dispatch: str, factor: float):
    config = moe_config(dispatch=dispatch, capacity_factor=factor)
    return run(config, random_state(config), *inputs())


@pytest.mark.parametrize(
    "dispatch, exchange", [("dropless", "ragged"), ("dropless", "padded"), ("capacity", "ragged")]
)
@pytest.mark.parametrize("mesh_name", RUNNABLE)
def test_expert_parallel_equals_one_device(mesh_name, dispatch, exchange):
    mesh = mesh_of(mesh_name)
    config = moe_config(dispatch=dispatch, capacity_factor=NO_DROPS, exchange=exchange)
    out, stats, grads = run(config, random_state(config), *inputs(), mesh=mesh)
    out_ref, stats_ref, grads_ref = one_device(dispatch, NO_DROPS)
    assert_trees_close(out, out_ref, err_msg=mesh_name)
    assert_trees_close(grads, grads_ref, err_msg=mesh_name)
    # Router statistics are global (computed outside the shard_map): what the bias update needs.
    np.testing.assert_array_equal(stats.load, stats_ref.load)
    np.testing.assert_allclose(stats.score_share, stats_ref.score_share, rtol=1e-6)
    assert float(stats.dropped_fraction) == 0.0
    if exchange == "ragged":  # padded: which branch runs depends on the loads (tested below)
        assert float(stats.exchange_worst_case) == 0.0
    assert np.asarray(stats.load)[-1] == 0


def busiest_exchange(experts: np.ndarray, parts: int, num_experts: int) -> tuple[int, int]:
    """(the most tokens a device sends one peer, the most rows a device receives), tokens split
    over the expert axis by batch row."""
    k = experts.shape[-1]
    owner = np.asarray(experts).reshape(parts, -1, k) // (num_experts // parts)  # [P, N, k]
    visits = owner[..., None] == np.arange(parts)  # [P(source), N, k, P(peer)]
    tokens = visits.any(2).sum(1).max()
    rows = visits.sum((0, 1, 2)).max()
    return int(tokens), int(rows)


@pytest.mark.parametrize("mesh_name", [n for n in ("ep2", "ep4") if n in RUNNABLE])
def test_padded_exchange_is_exact_whether_blocks_fit_or_not(mesh_name, monkeypatch):
    """Blocks exactly as large as the busiest device pair and device need (the usual branch,
    full), and one token or one row smaller (every device switches to the worst-case branch,
    as `padded_blocks` sizes it, in one round trip, or in 5 pieces whose last is padded): all
    equal one device."""
    mesh, parts = mesh_of(mesh_name), MESHES[mesh_name]["expert"]
    out_ref, stats_ref, grads_ref = one_device("dropless", NO_DROPS)
    config = moe_config(dispatch="dropless", exchange="padded")
    tokens, rows = busiest_exchange(stats_ref.experts, parts, config.moe.num_experts)
    num_tokens, k = B * S // parts, config.moe.experts_per_token
    _, worst = padded.padded_blocks(num_tokens, k, config.moe.num_experts, parts, 1.0)
    assert 1 < tokens <= num_tokens and 1 < rows < parts * num_tokens * k  # the usual exists
    rows_per_token = parts * min(k, config.moe.num_experts // parts)
    assert num_tokens % 5 and worst.pieces != 5
    in_one, in_five = [
        padded.Blocks(-(-num_tokens // n), -(-num_tokens // n) * rows_per_token, n) for n in (1, 5)
    ]
    cases = [
        ((tokens, rows), worst, 0.0),
        ((tokens - 1, rows), worst, 1.0),
        ((tokens, rows - 1), worst, 1.0),
        ((tokens - 1, rows), in_one, 1.0),
        ((tokens, rows - 1), in_five, 1.0),
    ]
    for usual, worst_case, took_worst in cases:
        blocks = padded.Blocks(*usual)
        monkeypatch.setattr(
            padded, "padded_blocks", lambda *a, usual=blocks, w=worst_case: (usual, w)
        )
        out, stats, grads = run(config, random_state(config), *inputs(), mesh=mesh)
        assert_trees_close(out, out_ref, err_msg=f"{mesh_name} {blocks} {worst_case}")
        assert_trees_close(grads, grads_ref, err_msg=f"{mesh_name} {blocks} {worst_case}")
        assert float(stats.exchange_worst_case) == took_worst


@pytest.mark.parametrize("num_experts, k, parts", [(4, 2, 2), (8, 3, 2), (8, 2, 4), (6, 4, 3)])
def test_padded_blocks_expect_the_share_of_tokens_reaching_a_peer(num_experts, k, parts):
    """The usual block is factor × N × the share of the C(E, k) choices of k distinct experts
    that include one of a given peer's E/P (counted here), capped by the worst case. The worst
    case covers every token reaching every peer with min(k, E/P) rows, in the fewest pieces whose
    rows stay under the usual rows plus one token's."""
    local = num_experts // parts
    rows_per_token = parts * min(k, local)
    choices = list(itertools.combinations(range(num_experts), k))
    share = sum(any(e < local for e in c) for c in choices) / len(choices)
    for tokens, factor in itertools.product((1000, 997, 3), (0.5, 1.0, 1.25, 4.0)):
        usual, worst = padded.padded_blocks(tokens, k, num_experts, parts, factor)
        assert usual.tokens == min(tokens, math.ceil(factor * tokens * share - 1e-9))
        assert usual.rows == min(
            parts * usual.tokens * min(k, local), math.ceil(factor * tokens * k)
        )
        assert usual.pieces == 1
        assert worst.rows == worst.tokens * rows_per_token
        assert worst.pieces * worst.tokens >= tokens > (worst.pieces - 1) * worst.tokens
        assert worst.rows < usual.rows + rows_per_token
        if worst.pieces > 1:  # one piece fewer would overflow the usual rows
            fewer = -(-tokens // (worst.pieces - 1))
            assert fewer * rows_per_token > usual.rows


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", [n for n in ("ep2", "ep4", "ep8") if n in RUNNABLE])
def test_expert_parallel_capacity_drops_as_each_device_alone(mesh_name):
    """Capacity is per (device, expert): EP equals the one-device block run on each token shard."""
    mesh = mesh_of(mesh_name)
    parts = mesh.shape["expert"]
    config = moe_config(dispatch="capacity", capacity_factor=1.0)
    state, (x, mask, cotangent) = random_state(config), inputs()
    out, stats, grads = run(config, state, x, mask, cotangent, mesh=mesh)

    rows = B // parts  # tokens are split over the expert axis by batch row
    shards = [
        run(config, state, *(a[i * rows : (i + 1) * rows] for a in (x, mask, cotangent)))
        for i in range(parts)
    ]
    dropped = np.mean([float(s[1].dropped_fraction) for s in shards])
    assert dropped > 0.05  # the skewed router overflows experts 0 and 1
    np.testing.assert_allclose(float(stats.dropped_fraction), dropped, rtol=1e-6)
    assert_trees_close(out, jnp.concatenate([s[0] for s in shards]))
    state_grads = jax.tree.map(lambda *g: sum(g), *[s[2]["state"] for s in shards])
    assert_trees_close(grads["state"], state_grads)
    assert_trees_close(grads["x"], jnp.concatenate([s[2]["x"] for s in shards]))


def test_expert_parallel_rejects_experts_that_do_not_divide_the_axis():
    mesh = mesh_of("ep4")
    config = moe_config(num_experts=6)
    with pytest.raises(ValueError, match="moe.num_experts=6 is not divisible by mesh.expert=4"):
        run(config, random_state(config), *inputs(), mesh=mesh)


def test_expert_weights_are_gathered_only_for_a_devices_own_experts():
    """fsdp=2 x expert=2: the map receives each device's E/P experts as fsdp shards, all-gathers
    those alone, and reduce-scatters their gradients: no [E, ...] expert array is ever gathered
    (before, every device received whole experts and all-reduced their gradients)."""
    config, mesh = moe_config(), mesh_of("ep2-fsdp2")
    state = random_state(config)
    for name, axes in zip(
        ("gate_proj", "up_proj", "down_proj"), EXPERT_WEIGHT_AXES
    ):
        spec = sharding.partition_spec(axes, state[name].shape, mesh)
        state[name] = jax.device_put(state[name], jax.sharding.NamedSharding(mesh, spec))
    x, mask, cotangent = inputs()
    hlo = jax.jit(lambda state: run(config, state, x, mask, cotangent, mesh))
    hlo = hlo.lower(state).compile().as_text()
    gathered = _collective_shapes(hlo, "all-gather")
    scattered = _collective_shapes(hlo, "reduce-scatter")
    num_experts, width, half = (
        config.moe.num_experts,
        config.moe.expert_dim,
        config.hidden_size // 2,
    )
    for whole, stored in (((2 * half, width), (half, width)), ((width, 2 * half), (width, half))):
        assert (num_experts, *whole) not in gathered, f"all experts {whole} gathered: {gathered}"
        assert (num_experts // 2, *whole) in gathered, f"local experts not in {gathered}"
        local_shard = (num_experts // 2, *stored)  # the gradient as stored: E/2 experts, D/2
        assert local_shard in scattered, f"{local_shard} not reduce-scattered: {scattered}"


def _collective_shapes(hlo: str, op: str) -> set[tuple[int, ...]]:
    """Result shapes of an op (all-gather, reduce-scatter) in compiled HLO text."""
    found = re.findall(r"= \w+\[([\d,]*)\]\S* " + op + r"\(", hlo)
    return {tuple(int(d) for d in dims.split(",") if d) for dims in found}


def test_ragged_all_to_all_emulation_matches_the_documented_example():
    """The example in `jax.lax.ragged_all_to_all`'s docstring, on 2 devices."""
    mesh = sharding.make_mesh({"expert": 2}, devices=jax.devices()[:2])
    args = {
        "operand": [[1, 2, 2], [3, 4, 0]],
        "output": [[0, 0, 0, 0], [0, 0, 0, 0]],
        "input_offsets": [[0, 1], [0, 1]],
        "send_sizes": [[1, 2], [1, 1]],
        "output_offsets": [[0, 0], [1, 2]],
        "recv_sizes": [[1, 1], [2, 1]],
    }
    args = [jnp.asarray(v, jnp.float32 if k in ("operand", "output") else jnp.int32).reshape(-1)
            for k, v in args.items()]  # fmt: skip
    emulated = jax.jit(
        jax.shard_map(
            ragged.ragged_all_to_all_by_gather,
            mesh=mesh,
            in_specs=PartitionSpec("expert"),
            out_specs=PartitionSpec("expert"),
        )
    )(*args)
    np.testing.assert_array_equal(emulated, [1, 3, 0, 0, 2, 2, 4, 0])


def _equations(jaxpr) -> list:
    """Every equation of a jaxpr, those of nested jaxprs (shard_map, scan, ...) included."""
    found = []
    for eqn in jaxpr.eqns:
        found.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found += _equations(sub)
    return found


def _gradient_equations(mesh) -> list:
    config = moe_config(exchange="ragged")
    state, (x, mask, cotangent) = random_state(config), inputs()

    def loss(state, x):
        graphdef, module_state = nnx.split(
            nnx.eval_shape(lambda: MoE(config, rngs=nnx.Rngs(0), mesh=mesh))
        )
        nnx.replace_by_pure_dict(module_state, state)
        return (nnx.merge(graphdef, module_state)(x, mask)[0] * cotangent).sum()

    return _equations(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(state, x).jaxpr)


def test_real_ragged_all_to_all_path_differentiates_like_the_emulation(monkeypatch):
    """The GPU path (jax.lax.ragged_all_to_all) cannot run on CPU, but it can be traced: its
    results must vary over the mesh axes like the rows sent (else autodiff inserts a psum of their
    gradient over the devices), and its gradient must hold the emulation's reductions, no more."""
    mesh = mesh_of("ep2-data2")
    psums = {}
    for emulate in (True, False):
        monkeypatch.setattr(expert_parallel, "_lacks_ragged_all_to_all", lambda _, e=emulate: e)
        equations = _gradient_equations(mesh)
        psums[emulate] = sorted(
            (str(e.params["axes"]), e.invars[0].aval.shape)
            for e in equations
            if e.primitive.name.startswith("psum")
        )
        ragged = [e for e in equations if e.primitive.name == "ragged_all_to_all"]
        assert len(ragged) == (0 if emulate else 4)  # there and back, forward and backward
        for e in ragged:
            assert "expert" in e.outvars[0].aval.mat.varying
            assert e.outvars[0].aval.mat.varying == e.invars[0].aval.mat.varying
    assert psums[False] == psums[True]
    # The gradients of the expert weights and of the shared expert's (inside the map, whole on
    # every device), each summed over the token axes.
    assert len(psums[True]) == 6


@pytest.mark.parametrize("padded", [False, True])
def test_expert_major_order_regroups_source_major_blocks(padded):
    # 3 sources, 2 local experts: (s0,e0) 1 row | (s0,e1) 2 | (s1,e1) 1 | (s2,e0) 2, then padding;
    # packed back to back (ragged exchange), or each source in its own block of 4 rows (padded).
    # Expert-major: e0 <- (s0,e0), (s2,e0); e1 <- (s0,e1), (s1,e1).
    counts = jnp.asarray([[1, 2], [0, 1], [2, 0]], jnp.int32)
    starts = jnp.asarray([0, 4, 8] if padded else [0, 3, 4], jnp.int32)
    num_rows = 12 if padded else 8
    order = ragged.expert_major_order(counts, starts, num_rows)
    none = num_rows  # padding rows have no sorted place
    if padded:
        expected = [0, 3, 4, none, 5, none, none, none, 1, 2, none, none]
    else:
        expected = [0, 3, 4, 5, 1, 2, none, none]
    np.testing.assert_array_equal(order.position, expected)
    # source inverts position where a sorted place exists; the places after the 6 rows: none
    source, real = np.asarray(order.source), np.flatnonzero(np.asarray(expected) < none)
    np.testing.assert_array_equal(source[np.asarray(expected)[real]], real)
    np.testing.assert_array_equal(source[6:], none)


if "ep8" not in RUNNABLE:  # the CPU suite's 4 devices: rerun the 8-device cases with 8

    @pytest.mark.slow
    def test_expert_parallel_on_8_devices():
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ["XLA_FLAGS"])
        env = {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=8"}
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "ep8"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert result.returncode == 0 and "skipped" not in result.stdout, (
            result.stdout + result.stderr
        )
        assert "deselected" in result.stdout  # -k ep8 picked the 8-device cases out of the file
        assert re.search(r"\b4 passed", result.stdout), result.stdout
