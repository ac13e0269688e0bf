"""Where a profiled program's device time goes: kernel time by name from a jax.profiler trace.

Usage (a trace written by `jax.profiler.trace(dir, create_perfetto_trace=True)`):
    python -m benchmarks.trace_summary DIR [--top 30] [--steps 3] [--timeline]

For each device it prints the time its kernels ran (summed, and as the union of their intervals,
which differ where streams overlap) and the kernels that took most of it, divided by --steps;
for each kernel also how much of its time ran beside communication (NCCL kernels on another
stream), where a kernel may be slowed by the SMs and memory bandwidth those take. Memory copies
(`MemcpyD2D`, `memcpy128`, ...) name no program part: each is attributed to the HLO op the trace
gives it (`hlo_op`) or else to the kernel that ran before it on its stream, and the report lists
each copy's largest origins. With `--hlo
DUMP` (the program run under `XLA_FLAGS="--xla_dump_to=DUMP --xla_dump_hlo_as_text"`) each XLA
fusion also gets the JAX op names it was fused from (`hlo_sources`), which name the model code
(transposes of AD, `jvp`, the functions on the way) that a fusion's own name does not.
With `--timeline` it prints instead each device stream's busy spans and its large host<->device
copies in time order: whether a program's copies to host memory ran beside its compute
(bench_checkpoint_save --trace writes such a trace of one save).
"""

import argparse
import bisect
import collections
import glob
import gzip
import json
import os
import re


def load_events(trace_dir: str) -> tuple[list[dict], dict[int, str]]:
    """The newest perfetto trace under `trace_dir`: its complete events and process names."""
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(max(paths, key=os.path.getmtime)) as f:
        events = json.load(f)["traceEvents"]
    processes = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    return [e for e in events if e.get("ph") == "X" and "dur" in e], processes


COMMUNICATION_PREFIX = "nccl"  # NCCL's kernels: ncclDevKernel_SendRecv, ..._AllReduce_...
COPY_MARK = "memcpy"  # the runtime's copies: MemcpyD2D, MemcpyH2D, memcpy128, ...


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals as sorted, disjoint intervals."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        elif end > start:
            merged.append((start, end))
    return merged


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    return sum(end - start for start, end in union(intervals))


def overlap(start: float, end: float, disjoint: list[tuple[float, float]]) -> float:
    """Length of [start, end) inside the sorted, disjoint intervals `disjoint`."""
    total = 0.0
    for a, b in disjoint[max(bisect.bisect_right(disjoint, (start,)) - 1, 0) :]:
        if a >= end:
            break
        total += max(0.0, min(end, b) - max(start, a))
    return total


def summarize(trace_dir: str, device_prefix: str = "/device:GPU") -> dict[str, dict]:
    """Per device (process name containing `device_prefix`): kernel time in µs by name,
    the summed and the busy (interval-union) time, the communication kernels' busy time, and
    each copy's time by origin (`copy_origins`)."""
    events, processes = load_events(trace_dir)
    by_device = collections.defaultdict(list)
    for event in events:
        name = processes.get(event["pid"], "")
        if device_prefix in name:
            by_device[name].append(event)
    if not by_device:
        print(
            f"trace_summary: no process named like {device_prefix!r} in {sorted(set(processes.values()))}"
        )
    out = {}
    for device, device_events in sorted(by_device.items()):
        spans = [(e["name"], e["ts"], e["ts"] + e["dur"], _communicates(e["name"]))
                 for e in device_events]  # fmt: skip
        communication = union([(a, b) for _, a, b, communicates in spans if communicates])
        kernels, beside_communication = collections.Counter(), collections.Counter()
        for name, start, end, communicates in spans:
            kernels[name] += end - start
            if not communicates:
                beside_communication[name] += overlap(start, end, communication)
        busy = busy_time([(a, b) for _, a, b, _ in spans])
        out[device] = dict(kernels=kernels, summed=sum(kernels.values()), busy=busy,
                           beside_communication=beside_communication,
                           communication_busy=busy_time(communication),
                           copy_origins=copy_origins(device_events))  # fmt: skip
    return out


def copy_origins(events: list[dict]) -> dict[str, collections.Counter]:
    """Copy name -> its time in µs by origin: the HLO op the trace names (`args.hlo_op`), else
    'after <kernel>', the last other event on its stream (pid, tid) before it."""
    origins = collections.defaultdict(collections.Counter)
    previous = {}
    for event in sorted(events, key=lambda e: e["ts"]):
        stream, name = (event["pid"], event.get("tid")), event["name"]
        if COPY_MARK in name.lower():
            op = (event.get("args") or {}).get("hlo_op")
            origin = op or f"after {previous.get(stream, 'nothing')}"
            origins[name][origin] += event["dur"]
        else:
            previous[stream] = name
    return origins


def _communicates(kernel_name: str) -> bool:
    return kernel_name.lower().startswith(COMMUNICATION_PREFIX)


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def hlo_sources(dump_dir: str, width: int = 3) -> dict[str, str]:
    """Kernel name -> the JAX op names (up to `width`, most frequent first) of the instructions of
    the fusion of that name, in the largest optimised HLO module under `dump_dir` (the training
    step's). A GPU kernel bears its fusion's name with '.' and '-' as '_'."""
    paths = glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))
    if not paths:
        return {}
    bodies, calls, current = collections.defaultdict(list), {}, None
    with open(max(paths, key=os.path.getsize)) as f:
        for line in f:
            if line and not line[0].isspace() and line.rstrip().endswith("{"):
                current = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
                continue
            match = _INSTRUCTION.match(line)
            if not match:
                continue
            bodies[current].append(line)
            called = re.search(r"calls=%?([\w.\-]+)", line)
            if " fusion(" in line and called:
                calls[match.group(1)] = (line, called.group(1))
    sources = {}
    for name, (line, computation) in calls.items():
        names = collections.Counter(
            op for text in [line, *bodies[computation]] for op in _OP_NAME.findall(text)
        )
        kernel = name.replace(".", "_").replace("-", "_")
        sources[kernel] = " | ".join(op for op, _ in names.most_common(width))
    return sources


_COPY_SIZE = re.compile(r"size:(\d+)")
HOST_COPIES = ("MemcpyD2H", "MemcpyH2D")


def timeline(trace_dir: str, device_prefix: str = "/device:GPU", gap_us: float = 2000,
             min_copy_bytes: int = 10**7) -> dict[str, dict]:  # fmt: skip
    """Per device stream (process name containing `device_prefix`, thread id): its busy spans
    (events closer than `gap_us` merged: [start, end, busy µs, events], µs from the trace's
    first event), and the host<->device copies of at least `min_copy_bytes` ([start, µs,
    bytes, name, HLO op]): whether a program's copies to or from the host ran beside its
    compute or before and after it."""
    events, processes = load_events(trace_dir)
    origin = min(e["ts"] for e in events)
    streams = collections.defaultdict(list)
    for event in events:
        if device_prefix in processes.get(event["pid"], ""):
            streams[(processes[event["pid"]], event.get("tid"))].append(event)
    out = {}
    for stream, stream_events in sorted(streams.items(), key=lambda kv: str(kv[0])):
        spans, copies = [], []
        for event in sorted(stream_events, key=lambda e: e["ts"]):
            start, end = event["ts"] - origin, event["ts"] + event["dur"] - origin
            if spans and start - spans[-1][1] <= gap_us:
                span = spans[-1]
                span[1], span[2], span[3] = max(span[1], end), span[2] + event["dur"], span[3] + 1
            else:
                spans.append([start, end, event["dur"], 1])
            args = event.get("args") or {}
            size = _COPY_SIZE.search(args.get("memcpy_details", ""))
            if event["name"] in HOST_COPIES and size and int(size.group(1)) >= min_copy_bytes:
                copies.append([start, event["dur"], int(size.group(1)), event["name"],
                               args.get("hlo_op", "")])  # fmt: skip
        out[f"{stream[0]} stream {stream[1]}"] = {"spans": spans, "copies": copies}
    return out


def timeline_report(streams: dict[str, dict], top: int = 40) -> str:
    """`timeline` as text (ms): each stream's first `top` spans, then the large host copies of
    all streams in time order."""
    lines = []
    for name, parts in streams.items():
        busy = sum(span[2] for span in parts["spans"])
        lines.append(f"{name}: {len(parts['spans'])} spans, busy {busy / 1e3:.1f} ms")
        for start, end, micros, count in parts["spans"][:top]:
            lines.append(f"  {start / 1e3:10.1f} -> {end / 1e3:10.1f} ms  busy {micros / 1e3:8.1f}"
                         f" ms  {count} events")  # fmt: skip
    copies = sorted((copy, name) for name, parts in streams.items() for copy in parts["copies"])
    lines.append(f"host copies of the streams above: {len(copies)}")
    for (start, micros, size, kind, op), name in copies:
        rate = size / micros / 1e3 if micros else float("inf")
        lines.append(f"  {start / 1e3:10.1f} ms +{micros / 1e3:7.1f} ms  {kind} "
                     f"{size / 1e9:6.2f} GB ({rate:.1f} GB/s)  {op}  [{name}]")  # fmt: skip
    return "\n".join(lines)


def report(summary: dict[str, dict], steps: int = 1, top: int = 30,
           sources: dict[str, str] | None = None) -> str:  # fmt: skip
    """The summary as text; `sources` (`hlo_sources`) adds each fusion's op names below it."""
    lines = []
    for device, parts in summary.items():
        lines.append(
            f"{device}: kernels {parts['summed'] / steps / 1e3:.2f} ms/step summed, "
            f"{parts['busy'] / steps / 1e3:.2f} ms/step busy"
        )
        for name, micros in parts["kernels"].most_common(top):
            beside = parts["beside_communication"][name]
            note = f"  ({beside / steps / 1e3:.3f} ms beside NCCL)" if beside else ""
            lines.append(f"  {micros / steps / 1e3:8.3f} ms  {name[:110]}{note}")
            if sources and name in sources:
                lines.append(f"               <- {sources[name][:300]}")
            origins = parts["copy_origins"].get(name) or collections.Counter()
            for origin, origin_micros in origins.most_common(5):
                lines.append(f"               {origin_micros / steps / 1e3:8.3f} ms {origin[:200]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_dir")
    parser.add_argument("--steps", type=int, default=1, help="profiled steps (divides times)")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--device-prefix", default="/device:GPU")
    parser.add_argument("--hlo", metavar="DUMP", help="XLA's dump of the traced program")
    parser.add_argument("--timeline", action="store_true",
                        help="each device stream's busy spans and large host copies in time order "
                             "instead of kernel totals")  # fmt: skip
    args = parser.parse_args()
    if args.timeline:
        print(timeline_report(timeline(args.trace_dir, args.device_prefix), args.top))
        return
    sources = hlo_sources(args.hlo) if args.hlo else None
    print(report(summarize(args.trace_dir, args.device_prefix), args.steps, args.top, sources))


if __name__ == "__main__":
    main()
