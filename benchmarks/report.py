"""Rates, the issue's targets, the Markdown report and the plots, computed from one run's results
(the dict that benchmarks/run.py writes to results.json). No timing happens here."""
from __future__ import annotations

import math
import os
import statistics


def malloc_note(malloc):
    """How this run's process allocated (run.py --malloc), in words."""
    if not malloc:
        return "not recorded (glibc's defaults before --malloc came in)"
    if malloc.get("applied"):
        return ("glibc, set by `gdn_jax.tune_host_malloc()` (one heap, no block mapped on its own, 1 GiB kept at the "
                "heap's top: README.md, Deployment); vLLM's harness the same")
    if malloc.get("mode") == "tuned":
        return "tuned requested, but the C library is not glibc: its defaults"
    return "glibc's defaults (--malloc system), here and in vLLM's harness"


def fmt(v, spec=".3f", none="-"):
    return none if v is None else format(v, spec)


BANDWIDTH_NAMES = {"rmw": "read-modify-write bandwidth", "read": "read bandwidth", "copy": "copy bandwidth",
                   "spec": "spec-pattern bandwidth"}


def is_spec_row(row):
    """A spec verify row (the op or the layer step, not the spec step's conv update): besides the
    read-modify-write bandwidth its target names, it is rated against the probe of its own pattern
    (roofline.BANDWIDTH_MODES "spec": a start slot read and written back, three more written with
    non-temporal stores), which moves 4 bytes written per byte read where the rmw probe moves 1."""
    return row.get("op") == "spec" or ("op" not in row and str(row.get("case", "")).startswith("spec"))


def bandwidth_kind(row):
    """The bandwidth a bytes row is held to: a conv prefill reads x and writes a fresh output (copy);
    decode, spec and the conv update read their state slots from a pool 4x the LLC (within a memory cap:
    roofline.cold_bytes) and write them back
    (read-modify-write). None for the decode_pool rows (the same 8 bf16 slots, 8 MiB, every call: they
    stay in the LLC; those rows compare pool sizes, not the machine): a DRAM roofline does not bound them."""
    if row.get("op") == "decode_pool":
        return None
    return "copy" if row.get("op") == "conv_fwd" else "rmw"


def add_rates(row, st, roof, suffix=""):
    """GB/s (unit "bytes": state or activation bytes read + written) or GFLOP/s (unit "flops") of one
    measurement and its fraction of the matching roofline (a measured bandwidth or the bf16 dot-product
    peak), under keys ending in `suffix`. A fraction above 1 means the probe undercounts what the
    machine does: the row gets "roofline_error" and the report prints that instead of the fraction."""
    if st is None or not row.get("unit") or not row.get("work"):
        return
    row.pop("roofline_error" + suffix, None)  # graded again (median_of_runs): today's roofline decides
    if row["unit"] == "bytes":
        rate, unit = row["work"] / st["median_ms"] / 1e6, "GB/s"
        row["gbs" + suffix] = rate
        kind = bandwidth_kind(row)
        if kind is None:
            return
        peak, name = roof.get(f"{kind}_bandwidth_gbs"), BANDWIDTH_NAMES[kind]
    else:
        rate, unit = row["work"] / st["median_ms"] / 1e6, "GFLOP/s"
        row["gflops" + suffix] = rate
        yard = fma_yardstick(row, roof)
        if yard:  # the prefill target's yardstick (issue #20: "the measured FMA peak")
            row["fma_yardstick_gflops"] = yard
            row["frac_fma_peak" + suffix] = rate / yard
            if rate > yard:
                row["roofline_error" + suffix] = (f"{rate:.1f} GFLOP/s is above the kernel's FMA yardstick "
                                                  f"({yard:.1f} GFLOP/s): the probe is wrong, no fraction printed")
                return
        peak, name = relevant_peak(roof)
    if row["unit"] == "bytes" and is_spec_row(row) and roof.get("spec_bandwidth_gbs"):
        row["frac_spec_pattern" + suffix] = rate / roof["spec_bandwidth_gbs"]
    if peak:
        row["roofline"], row["frac_roofline" + suffix] = name, rate / peak
        if rate > peak:
            row["roofline_error" + suffix] = (f"{rate:.1f} {unit} is above the measured {name} ({peak:.1f} {unit}): "
                                              "the probe is wrong, no fraction printed")


def fma_yardstick(row, roof):
    """The FMA peak a prefill row is held to: the f32 FMA peak, except that the flops the native chunk
    runs on the bf16 dot unit (`work_bf16_pairs`, with bf16 activations: Q S0 and K S0 on bf16 pairs
    where the ISA does so, ffi/README.md, "bf16 products with the state"; every matrix product on AMX
    tiles) count at the bf16 dot-product peak, i.e. the rate of a kernel running each of its two
    instruction mixes at its peak. None without an FMA reading."""
    f32 = roof.get("fma_peak_gflops")
    if not f32:
        return None
    pairs, dot = row.get("work_bf16_pairs") or 0, roof.get("bf16_dot_peak_gflops")
    if not pairs or not dot:
        return f32
    return row["work"] / ((row["work"] - pairs) / f32 + pairs / dot)


def relevant_peak(roof):
    """The compute roofline of a bf16-activation prefill in the tables and plots: the bf16 dot-product
    peak where it is known, else the f32 FMA peak. (The prefill target is graded on the FMA peak, as
    issue #20 words it, with any flops on the bf16 dot unit at the bf16 dot peak: `fma_yardstick`.)"""
    if roof.get("bf16_dot_peak_gflops"):
        return roof["bf16_dot_peak_gflops"], "bf16 dot peak"
    return roof.get("fma_peak_gflops"), "f32 FMA peak"


def _ops(res, op, case):
    return next((r for r in res.get("ops", []) if r["op"] == op and r["case"] == case), None)


def _layer(res, case, state):
    return next((r for r in res.get("layer", []) if r["case"] == case and r["state"] == state), None)


# --- targets (issue #20) -------------------------------------------------------------------------------


def meets(value, threshold, ge) -> bool:
    """A target's verdict: value >= threshold for a "≥" target, <= for a "≤" one."""
    return value >= threshold if ge else value <= threshold


def shown_value(value, pct, ge):
    """A target's value as printed beside its threshold (percent without decimals, or a ratio with
    two), rounded toward failing (down for a "≥" target, up for "≤"), so that a value printed equal
    to its threshold is one that met it (0.8487 of a "≥ 85%" target prints 84%, not 85%)."""
    x = value * 100  # the 1e-9: 0.87 computed as 0.86999... is 87%, not 86%
    x = math.floor(x + 1e-9) if ge else math.ceil(x - 1e-9)
    return f"{x}%" if pct else f"{x / 100:.2f}x"


# The ops whose times sum to a layer step's kernels, per layer case (case, state) -> [(op, case)].
def step_kernels(case, state):
    lab = "f32" if state == "fp32" else "bf16"
    if case.startswith("decode_b"):
        B = case[len("decode_b"):]
        return [("conv_update", f"B={B}"), ("decode", f"B={B} {lab}")]
    if case == "spec_8x4":
        return [("conv_update", "spec 8x4"), ("spec", f"8x4 {lab}")]
    if case.startswith("prefill_"):
        n = case[len("prefill_"):]
        n = f"T={n}" if "x" not in n else n
        return [("conv_fwd", n), ("gating", n), ("chunk", f"{n} {lab}")]
    return []


def kernel_sum(res, case, state):
    """(sum of the op medians of a layer case's kernels, what is missing)."""
    total, missing = 0.0, []
    for op, c in step_kernels(case, state):
        r = _ops(res, op, c)
        if r is None or "native" not in r:
            missing.append(f"{op} {c}")
        else:
            total += r["native"]["median_ms"]
    return total, missing


def _empty_call_note(res):
    """The empty jitted call warm and cold (run.empty_call_ms), the yardstick of "to handler" + "return"."""
    r = next((r for r in res.get("layer", []) if r.get("empty_call_cold_ms") is not None), None)
    if r is None:
        return ""
    mib = r["empty_call_cold_read_bytes"] / 2**20
    return (f" An empty jitted call took {1e3 * r['empty_call_ms']:.0f} µs back to back and "
            f"{1e3 * r['empty_call_cold_ms']:.0f} µs right after reading {mib:.0f} MiB with NumPy "
            "(no XLA work: the caches a step leaves): to handler + return near the cold figure is JAX's "
            "dispatch path on cold caches, paid once per jitted call, so once per forward in a model that "
            "jits its forward whole (the one-program table below).")


def _frac_target(add, target, case, row, suffix, thr, key="frac_roofline"):
    """A fraction-of-roofline target: `key` "frac_roofline" (the row's own roofline) or "frac_fma_peak"
    (a prefill row against the f32 FMA peak, its bf16 dot fraction in the note)."""
    if row is None or f"{key}{suffix}" not in row:
        return add(target, case, None, thr, f"{100 * thr:.0f}%", note="case not in this run (--quick?)")
    if row.get(f"roofline_error{suffix}"):
        return add(target, case, None, thr, f"{100 * thr:.0f}%", status="probe wrong",
                   note=row[f"roofline_error{suffix}"])
    rate = row.get(f"gbs{suffix}") or row.get(f"gflops{suffix}")
    unit = "GB/s" if f"gbs{suffix}" in row else "GFLOP/s"
    if key == "frac_fma_peak":
        note = f"{rate:.1f} {unit} of the f32 FMA peak"
        if row.get("work_bf16_pairs") and row.get("fma_yardstick_gflops"):
            what = row.get("work_bf16_what", "Q S0, K S0 on bf16 pairs")
            note += (f", {100 * row['work_bf16_pairs'] / row['work']:.0f}% of the flops ({what}) "
                     f"counted at the bf16 dot peak: {row['fma_yardstick_gflops']:.1f} GFLOP/s; "
                     f"{100 * row[f'frac_roofline{suffix}']:.0f}% of the bf16 dot peak")
        elif row.get("roofline") and row["roofline"] != "f32 FMA peak":
            note += (f"; {100 * row[f'frac_roofline{suffix}']:.0f}% of the {row['roofline']}, which the chunk's f32 "
                     "GEMMs do not use (the accuracy budgets: ffi/README.md, Limits)")
    else:
        note = f"{rate:.1f} {unit} of the {row['roofline']}"
    beside = row.get("probe_beside")
    if beside and beside.get("value"):  # run.py: a bandwidth for a bytes row, the FMA peak for a flops row
        # The run's best reading is the graded roofline; this one shows the row against the memory or
        # clock of its own minute (a shared host's bandwidth moves ~2x between minutes).
        note += f"; the probe just before the row read {beside['value']:.1f} {unit} ({100 * rate / beside['value']:.0f}% of it)"
        if beside.get("round_trip_ns"):
            note += f", its threads {beside['round_trip_ns']:.0f} ns apart"
    if f"frac_spec_pattern{suffix}" in row:
        note += _spec_pattern_note(row, rate, suffix)
    return add(target, case, row[f"{key}{suffix}"], thr, f"{100 * thr:.0f}%", note=note)


def _spec_pattern_note(row, rate, suffix):
    """A spec row against the probe of its own access pattern: the run's best reading and the one
    just before the row (where run.py took it)."""
    frac = row[f"frac_spec_pattern{suffix}"]
    note = f"; {100 * frac:.0f}% of the run's best spec-pattern reading"
    pat = row.get("pattern_probe_beside")
    if pat and pat.get("value"):
        note += f", {100 * rate / pat['value']:.0f}% of the one just before the row ({pat['value']:.1f} GB/s)"
    if frac > 1:
        note += " (above it: that probe undercounts the machine)"
    return note


def targets(res):
    """Each target of issue #20, the value measured in this run, and met / not met / not measured /
    not measurable here / probe wrong (a rate above its measured roofline)."""
    out = []
    vllm, env = res.get("vllm", {}), res.get("env", {})
    vllm_ran = vllm.get("status") == "ok"
    build_note = ""
    if vllm_ran and not vllm.get("avx512bf16_build"):
        libs = ", ".join(vllm.get("kernel_libs") or ["?"])
        build_note = f"vLLM loaded {libs}, not the AVX512-BF16 build"

    def add(target, case, value, threshold, shown, *, ge=True, status=None, note=""):
        if status is None:
            if value is None:
                status = "not measured"
            else:
                status = "met" if meets(value, threshold, ge) else "not met"
        out.append(dict(target=target, case=case, value=value, threshold=threshold,
                        threshold_shown=("≥ " if ge else "≤ ") + shown, status=status, note=note,
                        measured=None if value is None else shown_value(value, shown.endswith("%"), ge)))

    layer = res.get("layer", [])
    # 1. a serving step within 1.10x of its kernels (decode B = 1: 1.2x of its kernels + an empty jitted call)
    for r in layer:
        ksum, missing = kernel_sum(res, r["case"], r["state"])
        b1 = r["case"] == "decode_b1"
        thr = 1.2 if b1 else 1.1
        tgt = "serving step (alone) within 1.10x of its kernels (decode B=1: 1.2x of kernels + an empty jitted call)"
        pk = r.get("paired_kernels")
        if pk:  # timed in turns (benchmarks/step_overhead.py): the sections' drift cancels
            value = pk["step_over_kernels_plus_empty" if b1 else "step_over_kernels"]
            note = (f"paired over {pk['rounds']} rounds: step {pk['step_ms']:.3f} ms, kernels "
                    f"{sum(pk['kernel_ms'].values()):.3f} ms" + (f" + empty jitted call {pk['empty_ms']:.3f} ms" if b1 else "")
                    + ("" if missing or not ksum else
                       f"; unpaired (layer / ops sections) {r['native']['median_ms'] / ksum:.2f}x"))
            add(tgt, f"{r['case']} {r['state']}", value, thr, f"{thr}x", ge=False, note=note)
            continue
        if missing:
            add(tgt, f"{r['case']} {r['state']}", None, thr, f"{thr}x", ge=False,
                note="kernels not measured in this run: " + ", ".join(missing))
            continue
        empty = r.get("empty_call_ms") if b1 else None
        base = ksum + (empty or 0.0)
        add(tgt, f"{r['case']} {r['state']}", r["native"]["median_ms"] / base, thr, f"{thr}x", ge=False,
            note=f"step {r['native']['median_ms']:.3f} ms, kernels {ksum:.3f} ms"
                 + (f" + empty jitted call {empty:.3f} ms" if empty is not None else ""))
    # 2. decode and spec steps, B >= 8: >= 85% of the read-modify-write bandwidth, alone and interleaved
    #    (a jitted call after the matmul block's, and the two in one program: the step's handler)
    conds = (("", "alone"), ("_interleaved", "interleaved"), ("_in_program", "interleaved, one program"))
    for case in ("decode_b8", "decode_b32", "spec_8x4"):
        for st in ("fp32", "bf16"):
            for suffix, cond in conds:
                _frac_target(add, "decode/spec step: ≥ 85% of the read-modify-write bandwidth (state read + written)",
                             f"{case} {st} {cond}", _layer(res, case, st), suffix, 0.85)
    # 3. prefill steps, T >= 2048: >= 70% of the FMA peak
    for case in ("prefill_2048", "prefill_8192"):
        for suffix, cond in conds:
            _frac_target(add, f"prefill step: ≥ 70% of the f32 FMA peak (chunked algorithm's flops at "
                         f"C={res.get('chunk', 64)}; any on the bf16 dot unit at the bf16 dot peak)", f"{case} fp32 {cond}",
                         _layer(res, case, "fp32"), suffix, 0.7, key="frac_fma_peak")
    # 4. against the fast pure-JAX baseline, paired
    for case, st, thr in ([(f"decode_b{B}", s, 2.5) for B in (1, 8, 32) for s in ("fp32", "bf16")] +
                          [("spec_8x4", s, 2.5) for s in ("fp32", "bf16")] +
                          [(c, "fp32", 4.0) for c in ("prefill_512", "prefill_2048", "prefill_8192", "prefill_4x512")]):
        r = _layer(res, case, st)
        v = r.get("speedup_vs_jnp_baseline") if r else None
        note = ("case not in this run (--quick?)" if r is None else
                "no jnp baseline in this run" if v is None else
                f"paired: jnp {r['jnp_baseline']['median_ms']:.3f} ms ({r['jnp_baseline']['variant']}), gdn_jax "
                f"{r['native_paired']['median_ms']:.3f} ms")
        add(f"≥ {thr:g}x the fast pure-JAX baseline (layer step, paired)", f"{case} {st}", v, thr, f"{thr:g}x", note=note)
    # 5. never slower than vLLM's kernels where its build has them
    for r in res.get("ops", []):
        if not r.get("vllm_case"):
            continue
        tgt = "never slower than vLLM's kernel (op)"
        if not vllm_ran:
            if r is res["ops"][0]:
                add(tgt, "all ops", None, 1.0, "1.0x", note="vLLM not in this run (--vllm-python)"
                    + (f": {vllm['error']}" if vllm.get("error") else ""))
            continue
        hit = r.get("vllm")
        if hit is None or "median_ms" not in hit:
            add(tgt, f"{r['op']} {r['case']}", None, 1.0, "1.0x", status="not measurable here" if hit else None,
                note="vLLM's harness has no such row" if hit is None else f"vLLM's `{hit['op']}` failed: "
                f"{hit['error'][:90]}")
            continue
        ratio = hit["median_ms"] / r["native"]["median_ms"]
        # Where the host had put each side's threads (ffi/README.md, Limits): the two are timed minutes apart.
        ours_rt = (r.get("probe_beside") or {}).get("round_trip_ns")
        placement = ""
        if hit.get("round_trip_ns"):
            placement = (f"threads {hit['round_trip_ns']:.0f} ns apart for vLLM, "
                         + (f"{ours_rt:.0f} ns for gdn_jax" if ours_rt else "not read for gdn_jax"))
        note = "; ".join(x for x in (f"vLLM `{hit['op']}` {hit['median_ms']:.3f} ms, gdn_jax "
                                     f"{r['native']['median_ms']:.3f} ms", placement, build_note) if x)
        if hit.get("fallback"):  # "where its build has them": its fallback is shown, not graded
            add(tgt, f"{r['op']} {r['case']}", None, 1.0, "1.0x", status="not measurable here",
                note=f"vLLM's build has no native kernel for it; its fallback: {note} ({ratio:.2f}x)")
        elif hit.get("from_file"):  # a ratio across runs: shown, not graded
            add(tgt, f"{r['op']} {r['case']}", None, 1.0, "1.0x", status="not measured in this run",
                note=f"vLLM's row from {hit['from_file']}, not this run: {note} ({ratio:.2f}x)")
        else:
            add(tgt, f"{r['op']} {r['case']}", ratio, 1.0, "1.0x", note=note)
    # 6. no cost that grows with the pool size
    a, b = _ops(res, "decode_pool", "B=8 N=64 bf16"), _ops(res, "decode_pool", "B=8 N=2048 bf16")
    pp = b.get("paired_vs_n64") if b else None
    if pp:  # the two pool sizes timed in turns
        add("no cost that grows with the pool size N (decode B=8 bf16)", "N=2048 / N=64", pp["large_over_small"], 1.25,
            "1.25x", ge=False,
            note=f"paired over {pp['rounds']} rounds: {pp['small_ms']:.3f} ms at N=64, {pp['large_ms']:.3f} ms at "
                 f"N=2048 (2 GiB)" + (f"; unpaired rows {b['native']['median_ms'] / a['native']['median_ms']:.2f}x"
                                       if a else "") + "; 1.25x allows for this host's noise")
    elif a and b:
        v = b["native"]["median_ms"] / a["native"]["median_ms"]
        add("no cost that grows with the pool size N (decode B=8 bf16)", "N=2048 / N=64", v, 1.25, "1.25x", ge=False,
            note=f"{a['native']['median_ms']:.3f} ms at N=64, {b['native']['median_ms']:.3f} ms at N=2048 (2 GiB); "
                 f"1.25x allows for this host's noise")
    else:
        add("no cost that grows with the pool size N (decode B=8 bf16)", "N=2048 / N=64", None, 1.25, "1.25x",
            ge=False, note="case not in this run (--quick?)")
    # 7. make bench within 15 minutes (without vLLM)
    dur = env.get("duration_s")
    full = not env.get("quick") and all(x in (env.get("sections") or []) for x in ("roofline", "ops", "layer"))
    add("`make bench` within 15 minutes without vLLM (benchmarks/run.py, every section)", "this run",
        None if dur is None or not full else dur / 900, 1.0, "1.0x", ge=False,
        note=("not a full run" if not full else f"{dur / 60:.1f} min" if dur is not None else "duration not recorded")
        + (" (vLLM's harness ran too: its time excluded)" if vllm.get("cmd") else ""))
    return out


def grade(res):
    """Rates and fractions of the roofline for every row (from its medians and the run's roofline),
    then res["targets"]. Also what benchmarks/median_of_runs.py does to a stored results.json, so
    that runs are graded by today's rules."""
    roof = res.get("roofline", {})
    for r in res.get("ops", []) + res.get("layer", []):
        add_rates(r, r.get("native"), roof)
        add_rates(r, r.get("native_interleaved"), roof, "_interleaved")
        add_rates(r, r.get("native_in_program"), roof, "_in_program")
    res["targets"] = targets(res)
    return res


# --- Markdown -----------------------------------------------------------------------------------------


def _runs(roof, key):
    """A probe's readings: before the timings, beside the rows held to it (range and count), after."""
    xs, whens = roof.get(f"{key}_runs") or [], roof.get(f"{key}_when")
    if not whens or len(whens) != len(xs):  # a results.json from before the probes beside the rows
        return " / ".join(f"{x:.1f}" for x in xs)
    parts = [f"{w} {x:.1f}" for w, x in zip(whens, xs) if w != "beside"]
    beside = [x for w, x in zip(whens, xs) if w == "beside"]
    if beside:
        span = f"{beside[0]:.1f}" if len(beside) == 1 else f"{min(beside):.1f}-{max(beside):.1f}"
        parts.insert(1 if whens[0] != "beside" else 0,
                     f"beside {len(beside)} row{'s' if len(beside) > 1 else ''} {span}")
    return ", ".join(parts)


def _span(xs, f):
    return f"{min(xs):{f}}" if min(xs) == max(xs) else f"{min(xs):{f}}-{max(xs):{f}}"


def round_trips(roof, key="rmw_bandwidth"):
    """The core-to-core round trip measured with each reading of a probe (run.py), in two groups:
    within 2x of the shortest, and longer (a VM's vCPUs moved apart, e.g. onto two CCDs, where each
    has a memory path of its own); per group the round trips' and the readings' ranges. "" without
    round trips (a results.json from before them, or one CPU)."""
    pairs = [(r, x) for r, x in zip(roof.get(f"{key}_round_trip_ns") or [], roof.get(f"{key}_runs") or []) if r]
    if not pairs:
        return ""
    lo = min(r for r, _ in pairs)
    parts = []
    for g in ([p for p in pairs if p[0] <= 2 * lo], [p for p in pairs if p[0] > 2 * lo]):
        if g:
            parts.append(f"{_span([r for r, _ in g], '.0f')} ns at {len(g)} reading{'s' if len(g) > 1 else ''} "
                         f"({_span([x for _, x in g], '.1f')} GB/s)")
    return "; ".join(parts)


def _ms(st):
    if not st or "median_ms" not in st:
        return "-"
    return f"{st['median_ms']:.3f} ({st['p10_ms']:.3f}-{st['p90_ms']:.3f})"


def _ratio(v):
    return "-" if v is None else f"{v:.2f}x"


def _rate(r, suffix=""):
    if "gbs" + suffix in r:
        s = f"{r['gbs' + suffix]:.1f} GB/s"
    elif "gflops" + suffix in r:
        s = f"{r['gflops' + suffix]:.1f} GFLOP/s"
    else:
        return ""
    if r.get("roofline_error" + suffix):
        s += " (above its roofline: probe wrong)"
    elif "frac_roofline" + suffix in r:
        s += f" ({100 * r['frac_roofline' + suffix]:.0f}%)"
    return s


def _vllm_cell(hit):
    if hit is None:
        return "-"
    if "error" in hit:
        return "error"
    return _ms(hit)


def _files(paths):
    """'a file' or 'N files' (from_file: one path, as older results.json have it, or a list)."""
    n = 1 if isinstance(paths, str) else len(paths)
    return "a file" if n == 1 else f"{n} files"


def markdown(res, md_dir):
    env, roof, vllm = res["env"], res.get("roofline", {}), res.get("vllm", {})
    L = ["# Benchmark results", "",
         "Generated by `benchmarks/run.py` from one run (rerun `make bench` to refresh it; do not edit by hand). "
         "Times are medians with p10-p90 in parentheses, in ms; ratios are the other implementation's median "
         "over gdn_jax's (above 1: gdn_jax is faster). What limits each case: `benchmarks/README.md` "
         "(Analysis) and `ffi/README.md`.", ""]
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in env.get("flags", {}).items())
    cpu = env.get("cpu_model") or "?"
    topo = ", ".join(f"{k.replace('lscpu_', '').replace('_', ' ')} {env[k]}" for k in
                     ("lscpu_cpu_family", "lscpu_model", "lscpu_threads_per_core", "lscpu_cores_per_socket",
                      "lscpu_sockets", "lscpu_l3_cache",
                      "lscpu_hypervisor_vendor") if env.get(k))
    fc = [st.get("foreign_cores") for r in res.get("ops", []) + res.get("layer", [])
          for st in (r.get("native"), r.get("reference"), r.get("jnp_baseline")) if st and st.get("foreign_cores") is not None]
    if fc and statistics.median(fc) > 0.5:
        L += [f"**This run was taken under load**: other processes used a median of {statistics.median(fc):.2f} "
              f"(up to {max(fc):.2f}) of the machine's cores during the measurements (results.json has it per "
              "row). Absolute times, rates and the roofline itself are low by whatever share the others took, and "
              "differently for rows measured at different moments; ratios measured in turn (paired, interleaved / "
              "b2b pair) hold better than fractions of a roofline measured before and after.", ""]
    L += ["## Machine and run", "", "| | |", "|---|---|",
          f"| date | {env.get('date')} |",
          f"| command | `{env.get('command')}` |",
          f"| CPU | {cpu}, {env.get('logical_cpus')} logical CPUs" + (f" ({topo})" if topo else "") + " |",
          f"| CPU flags that matter | {flags} |",
          f"| gdn_jax ISA | {env.get('isa')} (available: {', '.join(env.get('available_isas', []))}) |",
          f"| software | jax {env.get('jax')}, python {env.get('python')} |",
          f"| malloc | {malloc_note(env.get('malloc'))} |",
          f"| timing | ≥ {env.get('target_s')} s of calls per case (≥ 5 calls), jitted, caches donated; "
          f"{'quick mode; ' if env.get('quick') else ''}other processes used up to "
          f"{max(fc) if fc else '?'} cores during a measurement (shared machine; per row in results.json); "
          + (f"an op row that others disturbed (> {env.get('op_foreign_max')} cores) is measured again at once, "
             f"up to {env.get('op_attempts')} attempts, and the quietest is kept (vLLM's harness does the same "
             "after waiting for quiet); " if (env.get("op_attempts") or 1) > 1 else "")
          + ("layer steps: gdn_jax and the jnp baseline timed in turn, one call each (order swapped every pair), "
             "so both see the same machine; " if any((r.get("jnp_baseline") or {}).get("paired")
                                                     for r in res.get("layer", [])) else "")
          + f"the jnp baseline {'re-measures' if env.get('baseline_waits_for_quiet') else 'does not re-measure'} "
          f"rows that others disturbed |"]
    if vllm.get("status") == "ok":
        v = (f"vllm {vllm.get('vllm')}, torch {vllm.get('torch')}, library {', '.join(vllm.get('kernel_libs') or [])}, "
             f"malloc {vllm.get('malloc')}, {vllm.get('threads') or '?'} torch threads (ours: "
             f"{roof.get('threads') or '?'}), harness in {vllm.get('mode') or ('--quick mode' if vllm.get('quick') else 'full mode')}, "
             + (f"results read from {_files(vllm['from_file'])} and a harness run before our timings"
                if vllm.get("from_file") and vllm.get("cmd")
                else f"results read from {_files(vllm['from_file'])}" if vllm.get("from_file")
                else "run before our timings"))
        if vllm.get("retry_wait_s") is not None:
            v += (f"; its wait for quiet before re-measuring a disturbed row set to {vllm['retry_wait_s']:g} s "
                  "(a patched copy)")
        if vllm.get("harness_error"):
            v += f"; the harness run failed ({vllm['harness_error']}), the files' rows are used"
        if vllm.get("patched"):
            v += "; the harness " + vllm.get("patch_note", "ran as a copy patched at run time")
        if vllm.get("round_trip"):
            v += ("; its bench() wrapped (a patched copy) to read the core round trip before each row, shown "
                  "beside the vLLM targets")
        L.append(f"| vLLM | {v} |")
    else:
        L.append(f"| vLLM | {vllm.get('status')}" + (f": {vllm['error']}" if vllm.get("error") else "") + " |")
    llc = roof.get("llc_bytes", 32 << 20)
    buf = roof.get("bandwidth_buffer_bytes", 256 << 20)
    bw_how = ("`gdn_jax_bandwidth_probe` (ffi/src/handlers/probe.cc): a jitted custom call on XLA's intra-op "
              f"pool, forked and joined like the kernels, over {buf >> 20} MiB ({buf / llc:.0f}x the "
              f"{llc >> 20} MiB LLC), 64 KiB pieces; bytes read + written; fastest of 7 calls; the best of the "
              "probes before the timings, just before each row held to it and after them")
    L += ["", "## Roofline (measured in this run)", "", "| quantity | value | how |", "|---|---:|---|",
          f"| read-modify-write bandwidth | {fmt(roof.get('rmw_bandwidth_gbs'), '.1f')} GB/s | the decode's access "
          f"pattern: each slot read and written back in place; {bw_how} ({_runs(roof, 'rmw_bandwidth')}) |",
          f"| read bandwidth | {fmt(roof.get('read_bandwidth_gbs'), '.1f')} GB/s | a sum over the buffer; same probe "
          f"({_runs(roof, 'read_bandwidth')}) |",
          f"| copy bandwidth | {fmt(roof.get('copy_bandwidth_gbs'), '.1f')} GB/s | dst = src, the stores' "
          f"read-for-ownership not counted; same probe ({_runs(roof, 'copy_bandwidth')}) |",
          f"| spec-pattern bandwidth | {fmt(roof.get('spec_bandwidth_gbs'), '.1f')} GB/s | the spec verify's "
          "access pattern: per 4 slots one read and written back in place, the other three written with the "
          f"kernels' non-temporal stores (1 byte read per 4 written); same probe ({_runs(roof, 'spec_bandwidth')}) |",
          f"| f32 FMA peak | {fmt(roof.get('fma_peak_gflops'), '.1f')} GFLOP/s | `fma_probe` of the {env.get('isa')} "
          f"kernels, {roof.get('threads')} threads; best of the probes as above ({_runs(roof, 'fma_peak')}) |",
          f"| bf16 dot-product peak | {fmt(roof.get('bf16_dot_peak_gflops'), '.1f')} GFLOP/s | "
          f"{roof.get('bf16_dot_peak_source', '-')} |"]
    rt = round_trips(roof)
    if rt:
        L.append(f"| core-to-core round trip | {rt} | a cache line between threads pinned to the first two CPUs, "
                 "measured with each rmw reading (`roofline.core_round_trip_ns`): where the host had put the two "
                 "threads for that reading (ffi/README.md, Limits) |")
    L += ["",
          "Decode, spec and conv-update rows report state bytes moved per second (read + written; the conv "
          "update's x and y besides) against the read-modify-write bandwidth (decode_pool rows report theirs "
          "without a roofline: their slots stay in the LLC between calls; spec rows, whose bytes are four-fifths "
          "writes, also against the spec-pattern bandwidth, in the targets' notes), conv prefill rows activation "
          "bytes against the copy bandwidth; chunk and "
          "prefill rows report the chunked algorithm's GFLOP/s (`run.chunk_flops`: ffi/README.md's count for the "
          f"chunk kernel at the chunk size gdn_jax uses, C = {res.get('chunk', 64)}; 8.0 MFLOP per value head and "
          "64-token chunk, 3.5 per 32-token chunk) against the bf16 dot-product peak; every implementation's "
          "time on a row is rated with that row's count. A rate "
          "above its roofline is not printed as a fraction: it means the probe undercounts the machine.", ""]
    errs = [(r.get("op") or r["case"], r.get("case") if r.get("op") else r["state"], r[k])
            for r in res.get("ops", []) + res.get("layer", []) for k in ("roofline_error", "roofline_error_interleaved", "roofline_error_in_program")
            if r.get(k)]
    if errs:
        L += ["**Rows above their measured roofline (the probe is wrong for them; their fractions are not "
              "printed):**", ""] + [f"* {a} {b}: {e}" for a, b, e in errs] + [""]
    # targets
    L += ["## Targets (issue #20), computed from this run", "",
          "| target | case | measured | target | status | note |", "|---|---|---:|---:|---|---|"]
    for t in res.get("targets", []):
        L.append(f"| {t['target']} | {t['case']} | {t['measured'] or '-'} | {t['threshold_shown']} | "
                 f"**{t['status']}** | {t['note']} |")
    counts = {}
    for t in res.get("targets", []):
        counts[t["status"]] = counts.get(t["status"], 0) + 1
    L += ["", "Summary: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".", ""]
    # layer
    if res.get("layer"):
        mb = next((r["native_interleaved"].get("matmul_block_ms") for r in res["layer"] if r.get("native_interleaved")),
                  None)
        L += ["## Layer steps: conv + gating + recurrence, as a user calls them", "",
              "`GDNAttention.decode / spec_decode / prefill` (native), cold state pools larger than the LLC. "
              "**alone**: back to back; **interleaved**: right after a jitted bf16 matmul block "
              f"({fmt(mb, '.0f')} ms, untimed), as between the layers of a model, timed in turn with a second step "
              "right after it (**b2b pair**), so that the ratio holds under this host's load; **kernels**: the "
              "sum of the step's op medians from the ops section (step / kernels; in brackets the same ratio with the "
              "step and its kernels timed in turns, `benchmarks/step_overhead.py`, which the target uses); "
              "**paired**: timed in turn with "
              "the fast pure-JAX baseline of `../shared/bench/jnp_baseline` (its best variant per case). vLLM: its "
              "GDN forward as vLLM calls it (its Python glue: conv + gating + core) and its core kernel alone.", "",
              "| case | state | alone ms | rate (% roofline) | interleaved ms | rate (% roofline) | interleaved / "
              "b2b pair | step / kernels | paired ms | jnp baseline ms | vs jnp | vLLM forward ms | vs vLLM forward | "
              "vLLM core ms | vs vLLM core |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in res["layer"]:
            ksum, missing = kernel_sum(res, r["case"], r["state"])
            kr = "-" if missing or not ksum else f"{r['native']['median_ms'] / ksum:.2f}x"
            if r.get("paired_kernels"):
                kr += f" ({r['paired_kernels']['step_over_kernels']:.2f}x paired)"
            L.append(f"| {r['case']} | {r['state']} | {_ms(r['native'])} | {_rate(r)} | "
                     f"{_ms(r.get('native_interleaved'))} | {_rate(r, '_interleaved')} | "
                     f"{_ratio(r.get('interleaved_over_b2b'))} | {kr} | {_ms(r.get('native_paired'))} | "
                     f"{_ms(r.get('jnp_baseline'))} | {_ratio(r.get('speedup_vs_jnp_baseline'))} | "
                     f"{_vllm_cell(r.get('vllm_forward'))} | {_ratio(r.get('speedup_vs_vllm_forward'))} | "
                     f"{_vllm_cell(r.get('vllm_core'))} | {_ratio(r.get('speedup_vs_vllm_core'))} |")
        L.append("")
        fj = [(r, r["native_interleaved"].get("fork_join"), (r.get("native_b2b_pair") or {}).get("fork_join"))
              for r in res["layer"] if r.get("native_interleaved")]
        fj = [x for x in fj if x[1] and x[2]]
        if fj:
            L += ["Where the interleaved step's time goes, interleaved / its back-to-back pair (medians per call): "
                  "CPU time and run-queue wait (runnable, not running) of this process's threads "
                  "(`/proc/self/task/*/schedstat`), and the fork/join of the kernels inside the step "
                  "(`parallel_counters`, ffi/src/parallel.h). More wait at the same CPU time is the scheduler, "
                  "not the kernels (ffi/README.md, Limits). **To handler**: from the call to the step handler's "
                  "entry (JAX's dispatch, XLA's launch); **handler**: the handler's own wall time (`StepTimer`); "
                  "**return**: from its return to the results in Python. **In parallel-fors**: wall time inside "
                  "the kernels' parallel-fors (fork to join), part of the handler's." + _empty_call_note(res), "",
                  "| case | state | wall ms | to handler µs | handler ms | return µs | in parallel-fors ms | CPU ms | "
                  "run-queue wait ms | parallel-fors | helper start µs | late helpers | ranges on helpers | "
                  "join wait µs |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for r, a, b in fj:
                ia, ib = r["native_interleaved"], r["native_b2b_pair"]
                L.append(f"| {r['case']} | {r['state']} | {fmt(ia.get('median_ms'), '.3f')} / {fmt(ib.get('median_ms'), '.3f')} | "
                         f"{fmt(a.get('to_handler_us'), '.0f')} / {fmt(b.get('to_handler_us'), '.0f')} | "
                         f"{fmt(a.get('handler_ms'), '.3f')} / {fmt(b.get('handler_ms'), '.3f')} | "
                         f"{fmt(a.get('return_us'), '.0f')} / {fmt(b.get('return_us'), '.0f')} | "
                         f"{fmt(a.get('job_ms'), '.3f')} / {fmt(b.get('job_ms'), '.3f')} | "
                         f"{fmt(ia.get('cpu_ms'), '.2f')} / {fmt(ib.get('cpu_ms'), '.2f')} | "
                         f"{fmt(ia.get('runqueue_wait_ms'), '.2f')} / {fmt(ib.get('runqueue_wait_ms'), '.2f')} | "
                         f"{a['jobs_per_call']:.0f} | {a['helper_start_us']:.0f} / "
                         f"{b['helper_start_us']:.0f} | {100 * a['late_helper_frac']:.0f}% / "
                         f"{100 * b['late_helper_frac']:.0f}% | {100 * a['helper_range_frac']:.0f}% / "
                         f"{100 * b['helper_range_frac']:.0f}% | {a['join_wait_us']:.0f} / {b['join_wait_us']:.0f} |")
            L.append("")
        prog = [r for r in res["layer"] if r.get("native_in_program")]
        if prog:
            L += ["The step inside one program, as a model runs it: one jitted program of the same matmul block and "
                  "then the step (`in_program_call`), timed in turn with the rows above. The step pays no dispatch "
                  "of its own there (a model's forward is one call), so its time is the handler's wall time "
                  "(`StepTimer`), set beside the handler's time of the back-to-back pair.", "",
                  "| case | state | in one program ms (handler) | rate (% roofline) | back-to-back handler ms | "
                  "one program / back to back | in parallel-fors ms |",
                  "|---|---|---:|---:|---:|---:|---:|"]
            for r in prog:
                p, b = r["native_in_program"], (r.get("native_b2b_pair") or {}).get("fork_join") or {}
                L.append(f"| {r['case']} | {r['state']} | {_ms(p)} | {_rate(r, '_in_program')} | "
                         f"{fmt(b.get('handler_ms'), '.3f')} | {_ratio(r.get('in_program_over_b2b_handler'))} | "
                         f"{fmt((p.get('fork_join') or {}).get('job_ms'), '.3f')} |")
            L.append("")
    if res.get("ops"):
        L += ["## Ops: each op alone", "",
              "Native kernels (through `jax.jit`) against the pure-jnp reference (`impl=\"reference\"`) and vLLM's "
              "kernel for the same case (the op vLLM uses on this CPU; a fallback is named).", "",
              "| op | case | native ms | tok/s | rate (% roofline) | reference ms | vs reference | vLLM op | "
              "vLLM ms | vs vLLM |", "|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
        for r in res["ops"]:
            nat = r.get("native")
            vh = r.get("vllm")
            L.append(f"| {r['op']} | {r['case']} | {_ms(nat)} | {fmt(nat and nat['tokens_per_s'], ',.0f')} | "
                     f"{_rate(r)} | {_ms(r.get('reference'))} | {_ratio(r.get('speedup_vs_reference'))} | "
                     f"{vh['op'] if vh else '-'} | {_vllm_cell(vh)} | {_ratio(r.get('speedup_vs_vllm'))} |")
        L.append("")
    if vllm.get("errors"):
        L += ["## vLLM rows that could not run", "", "| case | vLLM op | state | error |", "|---|---|---|---|"]
        for e in vllm["errors"]:
            L.append(f"| {e['case']} | {e['op']} | {e['state'] or ''} | {e['error'][:160]} |")
        L.append("")
    L += ["## Plots", ""]
    if res.get("plots"):
        for p in res["plots"]:
            rel = os.path.relpath(p, md_dir)
            L.append(f"![{os.path.basename(p)}]({rel})")
        L += ["", "(PNG files written by the run beside this report, in `plots/`.)", ""]
    else:
        L += [res.get("plots_note") or "No plots in this run.", ""]
    return "\n".join(L)


# --- plots -------------------------------------------------------------------------------------------


def _series(rows, key, xs_filter):
    pts = []
    for r in rows:
        st = r.get(key)
        if r.get("x") is None or not xs_filter(r) or not st or "tokens_per_s" not in st:
            continue
        pts.append((r["x"], st["tokens_per_s"]))
    return sorted(pts)


def plots(res, out_dir):
    """Throughput vs batch size (decode) and vs prompt length (prefill), one line per implementation,
    roofline as a horizontal line. Needs matplotlib (optional: the `bench` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        res["plots_note"] = ("Plots skipped: matplotlib is not importable (install the optional `bench` extra: "
                             "`pip install .[bench]`; `make bench` does).")
        print(res["plots_note"], flush=True)
        return []
    roof = res.get("roofline", {})
    ops_rows, layer_rows = res.get("ops", []), res.get("layer", [])
    paths = []
    styles = [("native", "gdn_jax op (native)", "o-"), ("reference", "gdn_jax reference op", "x:"),
              ("vllm", "vLLM kernel", "s--")]
    lstyles = [("native", "gdn_jax layer step", "o-"), ("native_interleaved", "gdn_jax layer step, interleaved", "v-"),
               ("native_in_program", "gdn_jax layer step, in one program (handler)", "s-"),
               ("jnp_baseline", "jnp baseline (layer)", "^-."),
               ("vllm_forward", "vLLM forward (layer)", "D--")]

    def lines(sel_ops, sel_layer):
        out = [(label, style, _series(ops_rows, key, sel_ops)) for key, label, style in styles]
        out += [(label, style, _series(layer_rows, key, sel_layer)) for key, label, style in lstyles]
        return [x for x in out if x[2]]

    def draw(ax, ls, roof_tps, roof_label, xlabel, title):
        from matplotlib.ticker import NullFormatter, ScalarFormatter

        xs = set()
        for label, style, pts in ls:
            ax.plot(*zip(*pts), style, label=label)
            xs |= {x for x, _ in pts}
        if roof_tps:
            ax.axhline(roof_tps, color="k", lw=1, ls="--", alpha=0.6, label=roof_label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(xs))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("tokens / s")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)

    # decode: one panel per state dtype that has data
    bw = roof.get("rmw_bandwidth_gbs")
    panels = []
    for st, lab in (("fp32", "f32"), ("bf16", "bf16")):
        ls = lines(lambda r, st=st: r["op"] == "decode" and r["state"] == st,
                   lambda r, st=st: r["case"].startswith("decode_b") and r["state"] == st)
        dec = [r for r in ops_rows + layer_rows if (r.get("op") == "decode" or r["case"].startswith("decode_b"))
               and r["state"] == st and r.get("work")]
        bpt = dec[0]["work"] / dec[0]["tokens"] if dec else None
        if ls:
            panels.append((ls, bw * 1e9 / bpt if bw and bpt else None, lab))
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
        for ax, (ls, roof_tps, lab) in zip(axes[0], panels):
            draw(ax, ls, roof_tps, f"state-bandwidth roofline (read-modify-write {bw:.1f} GB/s)" if bw else "", "batch size B",
                 f"decode, {lab} state (Qwen3-Next layer shapes, cold pool)")
        p = os.path.join(out_dir, "decode_throughput.png")
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        paths.append(p)
        plt.close(fig)
    # prefill
    ch = [r for r in ops_rows if r["op"] == "chunk" and r.get("x") and r["state"] == "fp32" and r.get("work")]
    peak, pname = relevant_peak(roof)
    fpt = ch[0]["work"] / ch[0]["tokens"] if ch else None
    if fpt is None:
        pre = [r for r in layer_rows if r["case"].startswith("prefill") and r.get("x")]
        fpt = pre[0]["work"] / pre[0]["tokens"] if pre else None
    ls = lines(lambda r: r["op"] == "chunk" and r["state"] == "fp32", lambda r: r["case"].startswith("prefill"))
    if ls:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        draw(ax, ls, peak * 1e9 / fpt if peak and fpt else None,
             f"compute roofline ({pname} {fmt(peak, '.0f')} GFLOP/s)", "prompt length T (one sequence)",
             "prefill: chunk op and whole step, f32 state")
        p = os.path.join(out_dir, "prefill_throughput.png")
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        paths.append(p)
        plt.close(fig)
    return paths
