"""m3-plan: the per-device memory and traffic of a training step on a mesh, without the hardware.

The train step that `m3-train` would run (pretrain/session.py, with its state and batch
shardings) is compiled ahead of time from abstract inputs (`jax.ShapeDtypeStruct`s with
shardings: nothing is allocated), for N H200s by XLA:GPU (`--target h200`: the program a GPU run
compiles, kernels included; pretrain/gpu_target.py) or for N fake CPU devices by XLA:CPU (the
default: no plugin needed, an estimate). Reported per device:
- params, optimizer state and buffers: exact, from the full model's shapes and shardings;
- activations and temporaries: the compiled program's temp buffers (`memory_analysis()`);
- collectives: bytes per step by op (pretrain/hlo_collectives.py);
- training FLOPs per token at the planned context (m3jax/cost_model.py, 3 × forward).
For XLA:CPU, GPU and TPU compilers fuse and schedule differently and take their own attention and
grouped-matmul paths, so the temporaries are an estimate of the same program. With `--layers L`
only the first L and L + 1 layers are compiled; temporaries and collectives grow by their
difference per remaining layer (the layers after L must all be of one kind), and the output says
so.
"""

import argparse
import collections
import dataclasses
import json
import math
import re
import sys

import jax
import jax.numpy as jnp

from batch_format.batch import make_batch
from m3jax import cost_model, sharding, xla_flags
from m3jax.model import functional
from pallas_kernels import target
from pretrain import gpu_target, hlo_collectives
from pretrain.cli import add_debug_flag, run_command
from pretrain.config import RunConfig, load_run_config
from pretrain.mfu import TRAINING_PER_FORWARD
from pretrain.session import TrainingSession

GB = 1e9
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


@dataclasses.dataclass(frozen=True)
class Plan:
    """Bytes per device of one training step; `compiled_layers` None = the whole model."""

    mesh: dict[str, int]
    batch_size: int  # rows of the global batch
    seq_len: int
    params: int
    opt_state: int
    buffers: int
    temporaries: int  # activations, gradients and every other buffer the step allocates
    collectives: dict[str, int]  # op -> bytes per step (hlo_collectives)
    flops_per_token: float  # training (forward + backward) FLOPs per token
    compiled_layers: tuple[int, int] | None
    notes: tuple[str, ...] = ()  # what was planned differently from the config, and why
    largest: tuple[str, ...] = ()  # the largest collectives of the (last) compiled program
    target: str = "cpu"  # what it was compiled for: "cpu" (fake devices) or a GPU's name
    kernels: dict[str, int] = dataclasses.field(default_factory=dict)  # custom-call target -> calls

    @property
    def total(self) -> int:
        """State plus temporaries: the updated state reuses the donated inputs' buffers."""
        return self.params + self.opt_state + self.buffers + self.temporaries

    def describe(self) -> str:
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1) or "one device"
        devices = math.prod(self.mesh.values())
        compiler = "XLA:CPU, fake devices" if self.target == "cpu" else f"XLA:GPU for {self.target}"
        rows = [
            f"mesh {mesh} ({devices} devices, {compiler}); "
            f"batch {self.batch_size} x {self.seq_len} tokens",
            f"  params        {self.params / GB:10.4g} GB per device",
            f"  optimizer     {self.opt_state / GB:10.4g} GB",
            f"  buffers       {self.buffers / GB:10.4g} GB",
            f"  temporaries   {self.temporaries / GB:10.4g} GB (activations, gradients, ...)",
            f"  total         {self.total / GB:10.4g} GB",
            f"  collectives   {hlo_collectives.summary(self.collectives)} GB per step",
            f"  training FLOPs per token {self.flops_per_token:.4g}",
        ]
        rows += [f"    {line}" for line in self.largest]
        if self.kernels:
            calls = ", ".join(f"{name} {count}" for name, count in self.kernels.items())
            rows.append(f"  custom calls in the compiled step: {calls}")
        rows += [f"  ({note})" for note in self.notes]
        if self.compiled_layers:
            low, high = self.compiled_layers
            rows.append(
                f"  (temporaries and collectives: compiled {low} and {high} layers, "
                "grown linearly to all layers)"
            )
        return "\n".join(rows)

    def as_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "total": self.total})


def plan(run: RunConfig, layers: int | None = None) -> Plan:
    """Plans `run` on its mesh (`run.mesh`) over the target devices (pallas_kernels/target.py:
    this process's fake CPU ones, or GPUs under `gpu_target.compiling_for`)."""
    run, notes = cpu_stand_ins(run) if target.platform() == "cpu" else (run, [])
    config = run.model
    session = TrainingSession(functional(config), run, checkpoints=None, report=lambda _: None)
    state, shardings = session.abstract_state, session.state_shardings
    state_bytes = {
        part: sharding.bytes_per_device(state[part], shardings[part])
        for part in ("params", "opt_state", "buffers")
    }
    if layers is None or layers >= config.num_layers:
        temporaries, collectives, largest, kernels = compile_step(session)
        compiled = None
    else:
        temporaries, collectives, largest, kernels = _grown_by_layers(run, layers)
        compiled = (layers, layers + 1)
    flops = TRAINING_PER_FORWARD * cost_model.forward_flops_per_token(config, run.data.seq_len)
    return Plan(
        mesh=dict(session.mesh.shape),
        batch_size=run.data.batch_size,
        seq_len=run.data.seq_len,
        params=state_bytes["params"],
        opt_state=state_bytes["opt_state"],
        buffers=state_bytes["buffers"],
        temporaries=temporaries,
        collectives=collectives,
        flops_per_token=flops,
        compiled_layers=compiled,
        notes=tuple(notes),
        largest=tuple(largest),
        target="cpu" if target.platform() == "cpu" else target.devices()[0].device_kind,
        kernels=kernels,
    )


def cpu_stand_ins(run: RunConfig) -> tuple[RunConfig, list[str]]:
    """`run` with what XLA:CPU would plan misleadingly replaced, and a note for each."""
    moe = run.model.moe
    if moe.dispatch != "dropless" or not run.model.moe_layers:
        return run, []
    # XLA:CPU expands ragged_dot into E masked dense products ([E, rows, D] temporaries)
    moe = dataclasses.replace(moe, dispatch="capacity", capacity_factor=moe.exchange_factor)
    note = (
        f"dropless MoE planned as capacity buffers of factor {moe.capacity_factor} "
        "(moe.exchange_factor): XLA:CPU expands ragged_dot into E dense masked products"
    )
    return dataclasses.replace(run, model=dataclasses.replace(run.model, moe=moe)), [note]


def compile_step(session: TrainingSession) -> tuple[int, dict[str, int], list[str], dict]:
    """(temp bytes per device, collective bytes per step, the largest collectives, calls by
    custom-call target) of the session's compiled step."""
    run = session.run
    shape = (run.data.batch_size, run.data.seq_len)
    ids, weights = (
        jax.ShapeDtypeStruct(shape, dtype, sharding=session.batch_sharding)
        for dtype in (jnp.int32, jnp.float32)
    )
    batch = make_batch(tokens=ids, targets=ids, positions=ids, segment_ids=ids, loss_mask=weights)
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        session.abstract_state,
        session.state_shardings,
    )
    # the session's own jitted step (shardings, donation): what m3-train compiles for batches
    # whose rows hold few documents (`ForwardMode.few_documents`: no kernel fallbacks)
    mode = dataclasses.replace(session.forward_mode(1), few_documents=True)
    compiled = session._step.lower(state, batch, mode).compile()
    memory = compiled.memory_analysis()
    hlo = compiled.as_text()
    return (
        memory.temp_size_in_bytes,
        hlo_collectives.collective_bytes(hlo),
        hlo_collectives.largest(hlo, 5),
        custom_calls(hlo),
    )


def custom_calls(hlo_text: str) -> dict[str, int]:
    """{custom-call target: calls in the program's text} (kernels: Mosaic GPU, Triton, cuDNN),
    most first; calls inside loops count once."""
    return dict(collections.Counter(_CUSTOM_CALL.findall(hlo_text)).most_common())


def _grown_by_layers(run: RunConfig, layers: int) -> tuple[int, dict[str, int], list[str], dict]:
    """Temporaries and collectives of all layers, from compiling `layers` and `layers` + 1."""
    config = run.model
    # from layer L - 2 on one kind: both compiles scan >= 2 of it (a scan of 1 plans differently)
    kinds = set(zip(config.layer_types[layers - 2 :], config.mlp_layer_types[layers - 2 :]))
    if layers < 2 or len(kinds) > 1:
        raise ValueError(
            f"--layers {layers}: layers {layers - 2}.. of the config must all be of one kind to "
            f"grow linearly, found {sorted(kinds)} (plan more layers)"
        )
    low, high = (compile_step(_session(run, n)) for n in (layers, layers + 1))
    extra = config.num_layers - layers - 1
    temporaries = high[0] + extra * (high[0] - low[0])
    ops = set(low[1]) | set(high[1])
    collectives = {
        op: high[1].get(op, 0) + extra * (high[1].get(op, 0) - low[1].get(op, 0)) for op in ops
    }
    return temporaries, collectives, high[2], high[3]


def _session(run: RunConfig, layers: int) -> TrainingSession:
    config = run.model
    model = dataclasses.replace(
        config,
        num_layers=layers,
        layer_types=config.layer_types[:layers],
        mlp_layer_types=config.mlp_layer_types[:layers],
    )
    run = dataclasses.replace(run, model=model)
    return TrainingSession(functional(model), run, checkpoints=None, report=lambda _: None)


def parse_mesh(text: str) -> dict[str, int]:
    """ "data=2,fsdp=4" -> {"data": 2, "fsdp": 4}; names are sharding.MESH_AXES."""
    sizes = {}
    for item in filter(None, text.split(",")):
        name, _, size = item.partition("=")
        if name not in sharding.MESH_AXES or not size.lstrip("-").isdigit():
            raise ValueError(
                f"--mesh: bad entry {item!r} (write axis=size, axes {sharding.MESH_AXES})"
            )
        sizes[name] = int(size)
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="m3-plan", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a run config YAML (configs/*.yaml)")
    parser.add_argument("--mesh", required=True, help="axis sizes, e.g. fsdp=16,expert=8")
    parser.add_argument("--devices", type=int, required=True, help="devices to plan on")
    parser.add_argument(
        "--target", choices=("cpu", "h200"), default="cpu",
        help="compile for fake CPU devices (XLA:CPU, an estimate) or for H200s (XLA:GPU ahead "
        "of time, no GPU needed; `make plan-gpu` installs jax's CUDA plugin)",
    )  # fmt: skip
    parser.add_argument("--layers", type=int, help="compile this many layers and one more, grow")
    parser.add_argument("--seq-len", type=int, help="tokens per row (default: data.seq_len)")
    parser.add_argument(
        "--batch-size", type=int, help="global rows (default: one per data-parallel device)"
    )
    parser.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    add_debug_flag(parser)
    args = parser.parse_intermixed_args(argv)
    return run_command("m3-plan", lambda: _plan_command(args), debug=args.debug)


def _plan_command(args) -> int:
    if args.target == "h200":
        xla_flags.apply()  # m3-train's XLA flags: the program it would compile
        gpu_target.start_without_gpu()  # before any backend starts
        with gpu_target.compiling_for(gpu_target.h200_devices(args.devices)):
            return _plan_devices(args)
    # before any device exists: N fake CPU devices (nothing is allocated on them)
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)
    if jax.device_count() != args.devices:
        raise RuntimeError(f"--devices {args.devices}: jax already has {jax.device_count()}")
    return _plan_devices(args)


def _plan_devices(args) -> int:
    mesh = {**dict.fromkeys(sharding.MESH_AXES, 1), **parse_mesh(args.mesh)}
    overrides = [f"mesh.{k}={v}" for k, v in mesh.items()] + list(args.overrides)
    run = load_run_config(args.config, overrides)
    rows = planned_rows(args.batch_size, args.overrides, run, _data_parallel(run))
    data = {"batch_size": rows, **({"seq_len": args.seq_len} if args.seq_len else {})}
    run = dataclasses.replace(run, data=dataclasses.replace(run.data, **data))
    result = plan(run, args.layers)
    print(result.describe())
    print(result.as_json())
    return 0


def planned_rows(
    batch_size: int | None, overrides: list[str], run: RunConfig, data_parallel: int
) -> int:
    """Global rows to plan: `--batch-size`, else a `data.batch_size=` override (the config as the
    run would take it), else one row per data-parallel device and accumulation step (a config's
    own batch is the whole job's, not what a planned slice holds)."""
    if batch_size:
        return batch_size
    if any(o.startswith("data.batch_size=") for o in overrides):
        return run.data.batch_size
    return data_parallel * run.train.grad_accum_steps


def _data_parallel(run: RunConfig) -> int:
    mesh = sharding.make_mesh(dataclasses.asdict(run.mesh))
    return math.prod(mesh.shape[a] for a in ("data", "fsdp", "expert"))


if __name__ == "__main__":
    sys.exit(main())
