"""Several processes, one run: joining them, sharing out the batch, and agreeing on what to do.

A multi-host run starts one `m3-train` process per host (or per GPU) with the same config and run
directory. Before JAX touches a device, `initialize` joins them through `jax.distributed`: from the
launcher's environment (SLURM under `srun`, a Cloud TPU pod slice, Kubernetes, Open MPI's `mpirun`:
jax's own auto-detection) or from explicit `--coordinator ADDR --num-processes N --process-id I`.
Alone (no flags, no launcher), nothing happens and nothing changes. After that each process sees
every device (`jax.devices()`) but feeds and reads only its own (`jax.local_devices()`), so:

- data: each process loads only its rows of a global batch (`batch_share`), from which the session
  builds global arrays (`jax.make_array_from_process_local_data`);
- checkpoints: Orbax writes the arrays from every process, but JSON items from process 0 only, so
  each process's data position is gathered (`gather`) into the data item and each takes its own
  back on restore (`own_data_state`);
- one voice: only process 0 (`is_primary`) prints, logs metrics and writes config.yaml;
- one stop: a signal reaches one process (a preempted host), and one process's data may run out,
  yet all must save the same step and stop, or the others wait forever in the next collective:
  after loading each batch the loop asks `any_process` (an 8-byte all-gather; it makes the host
  wait for the step before on the devices, which costs the overlap of one batch's loading).
"""

import argparse
import json

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

DATA_STATE_KEYS = ("process_count", "processes")


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-host (without them: the launcher's environment)")
    group.add_argument("--coordinator", help="ADDR:PORT of process 0, e.g. node-0:8476")
    group.add_argument("--num-processes", type=int, help="processes in the run (N)")
    group.add_argument("--process-id", type=int, help="this process's index, 0..N-1")


def initialize(args: argparse.Namespace) -> None:
    """Joins the run's processes (see the module doc); call before anything touches a device.
    ValueError for incomplete or inconsistent flags."""
    flags = (args.coordinator, args.num_processes, args.process_id)
    if any(flag is not None for flag in flags):
        if None in flags:
            raise ValueError(
                "--coordinator, --num-processes and --process-id go together; got "
                f"--coordinator={args.coordinator} --num-processes={args.num_processes} "
                f"--process-id={args.process_id}"
            )
        if not 0 <= args.process_id < args.num_processes:
            raise ValueError(
                f"--process-id={args.process_id} is not in 0..{args.num_processes - 1}"
            )
        if args.num_processes > 1:
            jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        return
    cluster = _detected_cluster()
    # One process of a launcher (`srun -n 1`, a one-host TPU VM) needs no coordinator (which
    # would take a port that another run of the same job may hold).
    if cluster is not None and cluster.get_process_count() > 1:
        jax.distributed.initialize()


def _detected_cluster():
    # jax's auto-detection itself (what jax.distributed.initialize() would use), asked first so
    # that a lone process starts no coordinator; a private module of the pinned jax 0.11.2.
    from jax._src.clusters import ClusterEnv

    return next(
        (env for env in ClusterEnv._cluster_types
         if not env.opt_in_only_method and env.is_env_present()),
        None,
    )  # fmt: skip


def is_primary() -> bool:
    """Whether this process speaks for the run (prints, logs, writes config.yaml): process 0."""
    return jax.process_index() == 0


def batch_share(batch_sharding: NamedSharding, rows: int, seq_len: int) -> tuple[int, int]:
    """(index, count): this process feeds block `index` of `count` equal blocks of a global
    [rows, seq_len] batch (processes whose devices hold the same rows share a block, whatever
    columns they hold); (0, 1) alone. ValueError if its devices hold rows that are not one such
    block."""
    if jax.process_count() == 1:
        return 0, 1
    indices = batch_sharding.addressable_devices_indices_map((rows, seq_len)).values()
    starts = sorted({index[0].indices(rows)[0] for index in indices})
    stops = sorted({index[0].indices(rows)[1] for index in indices})
    start, stop = starts[0], stops[-1]
    size = stop - start
    shard = stops[0] - starts[0]
    if len(starts) * shard != size or start % size:
        raise ValueError(
            f"process {jax.process_index()}'s devices hold rows {start}..{stop} of a batch of "
            f"{rows} in pieces {starts}: not one block of equal blocks; order the mesh's devices "
            "by process"
        )
    return start // size, rows // size


def any_process(*values: int) -> tuple[int, ...]:
    """Each value's largest over the processes (a collective: all call it at the same point)."""
    if jax.process_count() == 1:
        return values
    gathered = multihost_utils.process_allgather(np.asarray(values, np.int32))  # [processes, n]
    return tuple(int(v) for v in np.max(gathered, axis=0))


def gather(value) -> list:
    """Every process's JSON-serialisable `value`, in process order, on every process (a collective:
    every process calls it at the same point)."""
    if jax.process_count() == 1:
        return [value]
    encoded = np.frombuffer(json.dumps(value).encode(), np.uint8)
    lengths = multihost_utils.process_allgather(np.int32(encoded.size))
    padded = np.zeros(int(np.max(lengths)), np.uint8)
    padded[: encoded.size] = encoded
    rows = multihost_utils.process_allgather(padded)  # [processes, longest]
    return [json.loads(bytes(row[:length])) for row, length in zip(rows, lengths)]


def data_item(process_states: list) -> dict:
    """The checkpoint's data item: every process's loader position."""
    return {"process_count": len(process_states), "processes": process_states}


def own_data_state(saved: dict) -> dict:
    """This process's loader position from a checkpoint's data item. Another process count is
    fine where every process saved the same position (the text loader's is one global row
    count); otherwise ValueError. A data item of one bare position (checkpoints written before
    multi-host support) counts as one process's."""
    if not (isinstance(saved, dict) and set(saved) == set(DATA_STATE_KEYS)):
        saved = data_item([saved])
    states, count = saved["processes"], jax.process_count()
    if len(states) == count:
        return states[jax.process_index()]
    if all(state == states[0] for state in states):
        return states[0]
    raise ValueError(
        f"it was saved by {len(states)} processes, each with its own data position (their "
        f"loaders read different documents), and this run has {count}: resume it with "
        f"{len(states)} processes"
    )
