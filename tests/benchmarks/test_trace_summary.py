"""benchmarks/trace_summary.py: kernel time per device from a perfetto trace, overlaps counted once
in the busy time."""

import gzip
import json

import pytest

from benchmarks import trace_summary


def write_trace(folder, events):
    run = folder / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    processes = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
    ]
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": processes + events}, f)


def kernel(name, start, duration, pid=1, tid=7, **args):
    event = {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": start, "dur": duration}
    return {**event, "args": args} if args else event


def test_busy_time_counts_overlaps_once():
    assert trace_summary.busy_time([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert trace_summary.busy_time([]) == 0


def test_summary_sums_kernels_per_device_and_skips_the_host(tmp_path):
    write_trace(
        tmp_path,
        [
            kernel("gemm", 0, 100),
            kernel("nccl", 60, 100),  # overlaps the gemm by 40 µs
            kernel("gemm", 300, 40),
            kernel("python", 0, 1000, pid=2),  # host: not a device kernel
        ],
    )
    summary = trace_summary.summarize(str(tmp_path))
    assert list(summary) == ["/device:GPU:0"]
    gpu = summary["/device:GPU:0"]
    assert gpu["kernels"] == {"gemm": 140, "nccl": 100}
    assert gpu["summed"] == 240 and gpu["busy"] == 200
    text = trace_summary.report(summary, steps=2)
    assert "0.12 ms/step summed, 0.10 ms/step busy" in text  # 240 µs and 200 µs over 2 steps
    assert text.index("gemm") < text.index("nccl")  # most time first
    assert gpu["beside_communication"] == {"gemm": 40}
    assert "0.070 ms  gemm  (0.020 ms beside NCCL)" in text


def test_copies_are_attributed_to_their_hlo_op_or_the_kernel_before_them_on_their_stream(
    tmp_path,
):
    write_trace(
        tmp_path,
        [
            kernel("MemcpyD2D", 500, 30, tid=9),  # first on its stream: after nothing
            kernel("cond_fusion", 0, 100),
            kernel("gemm", 50, 100, tid=9),  # another stream: not the copy's predecessor
            kernel("MemcpyD2D", 200, 40),
            kernel("MemcpyD2D", 300, 20, hlo_op="copy.7"),  # the trace names its op
            kernel("memcpy128", 400, 10),
        ],
    )
    gpu = trace_summary.summarize(str(tmp_path))["/device:GPU:0"]
    assert gpu["copy_origins"]["MemcpyD2D"] == {
        "after cond_fusion": 40, "copy.7": 20, "after gemm": 30
    }
    assert gpu["copy_origins"]["memcpy128"] == {"after cond_fusion": 10}  # a copy is no kernel
    text = trace_summary.report({"/device:GPU:0": gpu}, steps=1)
    lines = text.splitlines()
    copy = next(i for i, line in enumerate(lines) if line.endswith("ms  MemcpyD2D"))
    assert [line.split(" ms ")[1] for line in lines[copy + 1 : copy + 4]] == [
        "after cond_fusion", "after gemm", "copy.7"
    ]  # most time first


def test_overlap_with_disjoint_intervals():
    disjoint = trace_summary.union([(10, 20), (15, 30), (40, 50), (60, 60)])
    assert disjoint == [(10, 30), (40, 50)]  # merged; the empty interval dropped
    assert trace_summary.overlap(0, 100, disjoint) == 30
    assert trace_summary.overlap(25, 45, disjoint) == 10
    assert trace_summary.overlap(30, 40, disjoint) == 0
    assert trace_summary.overlap(12, 14, disjoint) == 2


def test_missing_trace_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="perfetto_trace"):
        trace_summary.summarize(str(tmp_path))


MUL = 'metadata={op_name="jit(step)/transpose(jvp(loss))/mul"}'
FUSION = "  ROOT %loop_multiply_fusion.3 = f32[8]{0} fusion(%p), kind=kLoop, " + (
    f"calls=%fused_computation.3, {MUL}")  # one line in the module, as XLA writes it
HLO = f"""HloModule jit_step, entry_computation_layout={{()->f32[8]}}

%fused_computation.3 (param_0: f32[8]) -> f32[8] {{
  %param_0 = f32[8]{{0}} parameter(0)
  %exp.1 = f32[8]{{0}} exponential(%param_0), metadata={{op_name="jit(step)/jvp(loss)/exp"}}
  ROOT %multiply.2 = f32[8]{{0}} multiply(%exp.1, %exp.1), {MUL}
}}

ENTRY %main.9 (p: f32[8]) -> f32[8] {{
  %p = f32[8]{{0}} parameter(0), metadata={{op_name="x"}}
{FUSION}
}}
"""

def test_hlo_sources_name_each_fusion_by_the_jax_ops_fused_into_it(tmp_path):
    dump = tmp_path / "hlo"
    dump.mkdir()
    (dump / "module_0001.jit_step.sm_9.0_gpu_after_optimizations.txt").write_text(HLO)
    (dump / "module_0000.jit_tiny.sm_9.0_gpu_after_optimizations.txt").write_text("HloModule x\n")
    sources = trace_summary.hlo_sources(str(dump))
    assert sources == {"loop_multiply_fusion_3": "jit(step)/transpose(jvp(loss))/mul | "
                                                 "jit(step)/jvp(loss)/exp"}  # fmt: skip
    assert trace_summary.hlo_sources(str(tmp_path / "nowhere")) == {}
    write_trace(tmp_path, [kernel("loop_multiply_fusion_3", 0, 50), kernel("gemm", 0, 10)])
    text = trace_summary.report(trace_summary.summarize(str(tmp_path)), sources=sources)
    lines = text.splitlines()
    fusion = next(i for i, line in enumerate(lines) if "loop_multiply_fusion_3" in line)
    assert lines[fusion + 1].strip() == f"<- {sources['loop_multiply_fusion_3']}"
    assert "<-" not in lines[fusion + 2]  # the gemm has no fusion of its name


def test_timeline_lists_spans_and_large_host_copies_in_time_order(tmp_path):
    def copy(kind, start, duration, size, tid, op):
        details = f"kind_src:device kind_dst:pinned size:{size} async:1"
        return kernel(kind, start, duration, tid=tid, hlo_op=op, memcpy_details=details)

    write_trace(
        tmp_path,
        [
            kernel("fusion", 1000, 500),  # compute stream 7: two spans, 4 ms apart
            kernel("gemm", 1600, 400),
            kernel("fusion", 6000, 1000),
            copy("MemcpyD2H", 3000, 2000, 10**8, 9, "copy-start.2"),  # 0.1 GB at 50 GB/s
            copy("MemcpyD2H", 1000, 1000, 5 * 10**7, 8, "copy-start.1"),
            copy("MemcpyD2H", 2000, 10, 1000, 8, "copy-start.3"),  # small: not listed
            kernel("python", 0, 9000, pid=2),  # host
        ],
    )
    streams = trace_summary.timeline(str(tmp_path), gap_us=2000)
    assert set(streams) == {f"/device:GPU:0 stream {t}" for t in (7, 8, 9)}
    # µs from the trace's first event (the host's, at 0)
    spans = [[1000, 2000, 900, 2], [6000, 7000, 1000, 1]]  # [start, end, busy, events]
    assert streams["/device:GPU:0 stream 7"]["spans"] == spans
    assert streams["/device:GPU:0 stream 8"]["copies"] == [
        [1000, 1000, 5 * 10**7, "MemcpyD2H", "copy-start.1"]
    ]
    text = trace_summary.timeline_report(streams)
    listed = [line for line in text.splitlines() if "MemcpyD2H" in line]
    assert len(listed) == 2 and "copy-start.1" in listed[0] and "copy-start.2" in listed[1]
    assert "0.10 GB (50.0 GB/s)" in listed[1]
