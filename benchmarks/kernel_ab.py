"""A kernel change against a base revision, both builds in one process on one thread.

Exports the base revision's ffi/ (git archive), builds gdn_kernel_ab (benchmarks/cpp/kernel_ab.cc)
with CMake's GDN_AB_BASE / GDN_AB_ISA, which compiles that revision's ISA unit beside this tree's,
and runs it in --processes fresh processes pinned to one CPU. Each case (Qwen3-Next-80B shapes,
bf16 activations, f32 state unless the case says bf16) calls both builds in turn and prints the
median and p25-p75 of the per-round ratios new / base and whether the two wrote the same bits;
the summary is the median of the processes' medians with their range. The same source on both
sides reads within ~2% of 1 (benchmarks/README.md, "A kernel change against a base revision"). It
times the kernels alone on one thread: a change that moves the serving step's memory traffic or
threads still needs the step timed (benchmarks/run.py, step_overhead.py).

    PYTHONPATH=. python benchmarks/kernel_ab.py                      # HEAD against the working tree
    PYTHONPATH=. python benchmarks/kernel_ab.py --base HEAD~2 --cases chunk,conv_chunk --rounds 20
    PYTHONPATH=. python benchmarks/kernel_ab.py --isa avx2 --tokens 512 --batch 1

Cases: gating, conv_fwd (T tokens), conv_update (B rows, a cold pool), decode and decode_bf16 (the
recurrence, B rows, a cold pool of --pool-mib, f32 or bf16 state), spec and spec_bf16 (B rows of 4
tokens), chunk (T tokens from a state), conv_chunk (the serving step's fused conv + chunk), in_proj
and out_proj (the layer's packed projections of T tokens: qkv and z in one call; out_proj; w cycled
over copies holding --pool-mib). The
two revisions' ffi/include/gdn/types.h must be the same (CMake checks).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def export_ffi(rev, dest):
    """The ffi/ folder of revision `rev` under dest (replacing what was there)."""
    if os.path.isdir(dest):
        shutil.rmtree(dest)
    os.makedirs(dest)
    with tempfile.TemporaryFile() as tar:
        sh(["git", "-C", ROOT, "archive", "--format=tar", rev, "ffi"], stdout=tar)
        tar.seek(0)
        with tarfile.open(fileobj=tar) as t:
            if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4: no links or paths out of dest
                t.extractall(dest, filter="data")
            else:
                t.extractall(dest)


def tool(name):
    """A build tool from the venv running this script, else from PATH."""
    local = os.path.join(os.path.dirname(sys.executable), name)
    return local if os.access(local, os.X_OK) else shutil.which(name)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="the revision to compare against (default HEAD)")
    ap.add_argument("--isa", default="avx512bf16", help="the ISA unit to compare (this CPU must run it)")
    ap.add_argument("--cases", default="gating,conv_fwd,conv_update,decode,chunk,conv_chunk",
                    help="comma-separated, or 'all' (the driver's list, gdn_kernel_ab's usage line)")
    ap.add_argument("--tokens", type=int, default=2048,
                    help="T of gating, conv_fwd, chunk, conv_chunk, in_proj, out_proj")
    ap.add_argument("--batch", type=int, default=8, help="B of conv_update and decode")
    ap.add_argument("--pool-mib", type=int, default=256,
                    help="decode's state pool (conv_update's: 3/4 of it); in_proj's and out_proj's w copies "
                         "hold as many bytes")
    ap.add_argument("--rounds", type=int, default=12, help="rounds per process")
    ap.add_argument("--processes", type=int, default=3,
                    help="fresh processes (each places the two builds' code and data anew)")
    ap.add_argument("--round-ms", type=float, default=200.0, help="time of one build's calls per round")
    ap.add_argument("--expect-same-bits", action="store_true",
                    help="exit with status 1 if any case's outputs or state differ between the builds")
    ap.add_argument("--cpu", type=int, default=None, help="the CPU to pin to (default: the last one allowed)")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build", "kernel_ab"))
    args = ap.parse_args(argv)

    cmake = tool("cmake")
    if cmake is None:
        sys.exit("kernel_ab: needs cmake (make venv installs it into .venv)")
    rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", args.base], check=True, capture_output=True,
                         text=True).stdout.strip()
    src = os.path.join(args.build_dir, "base-src")
    build = os.path.join(args.build_dir, args.isa)
    print(f"kernel_ab: base {args.base} ({rev}) against the working tree, ISA {args.isa}", flush=True)
    export_ffi(rev, src)
    gen = ["-G", "Ninja"] if tool("ninja") else []
    sh([cmake, "-S", ROOT, "-B", build, *gen, "-DCMAKE_BUILD_TYPE=Release", "-DGDN_BUILD_PYTHON=OFF",
        f"-DGDN_AB_BASE={src}", f"-DGDN_AB_ISA={args.isa}"], stdout=subprocess.DEVNULL)
    print("kernel_ab: building (the first build compiles every ISA unit and the base's: a few minutes)", flush=True)
    sh([cmake, "--build", build, "-j", str(os.cpu_count() or 2), "--target", "gdn_kernel_ab"],
       stdout=subprocess.DEVNULL)

    cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
    cmd = [os.path.join(build, "gdn_kernel_ab"), "--cases", args.cases, "--tokens", str(args.tokens),
           "--batch", str(args.batch), "--pool-mib", str(args.pool_mib), "--rounds", str(args.rounds),
           "--round-ms", str(args.round_ms), "--expect-same-bits", "1" if args.expect_same_bits else "0"]
    os.sched_setaffinity(0, {cpu})  # inherited by the runs: one pinned thread
    ratios = {}
    for i in range(args.processes):
        print(f"kernel_ab: process {i + 1} of {args.processes}, pinned to CPU {cpu}", flush=True)
        run = subprocess.run(cmd, capture_output=True, text=True)
        sys.stdout.write(run.stdout)
        sys.stderr.write(run.stderr)
        if run.returncode != 0:
            return run.returncode
        for case, ratio in parse_ratios(run.stdout).items():
            ratios.setdefault(case, []).append(ratio)
    print(summary(ratios))
    return 0


ROW = re.compile(r"^(\S+)\s+.*?\s([\d.]+)\s+([\d.]+)\s+([\d.]+) \(([\d.]+)-([\d.]+)\)\s")


def parse_ratios(text):
    """{case: the process's median ratio new / base} from gdn_kernel_ab's table."""
    out = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            out[m.group(1)] = float(m.group(4))
    return out


def summary(ratios):
    """Per case: the median over processes of their median ratios, and their range."""
    lines = ["", "new / base, the median of the processes' medians (their range); below 1: the working tree is faster"]
    for case, r in ratios.items():
        lines.append(f"  {case:<12} {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f}, {len(r)} processes)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
