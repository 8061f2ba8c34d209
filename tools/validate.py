#!/usr/bin/env python3
"""remat's plans against per-GPU memory that others measured on real training runs.

Runs `remat plan` for every case of validation/cases.json (each case: its source, the measured
bytes and their kind, and the plan's flags), reads the predicted bytes of the measured rank from
the plan's JSON, and writes a markdown report: every case with its ratio, the summary, and the
published runs remat cannot express, each with the reason.

Cases measured by this repository's own tools/gpu_memory.py (family "measured-here") read their
bytes from its results file (validation/h200.json) and count in a summary row of their own.

With --check it fails (exit 1) when a case's prediction is lower than the measured bytes by more
than the uncertainty the plan itself claims (its "margin" for allocated bytes, its
"reserved_uncertainty" for reserved ones): the margin a plan keeps free must cover what the model is
seen to miss. A prediction that high is listed, not failed: it wastes memory, it does not run out.
It also fails when a run measured here held more outside PyTorch's allocator than the plan counts
there (the CUDA context and NCCL's buffers): the budget the plan gives the allocator would be short.

Usage: tools/validate.py --remat build/remat --cases validation/cases.json [--markdown docs/validation.md] [--check]
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

GIB = float(1 << 30)


def predicted(plan, measured):
    """The plan's bytes for what was measured (its kind, allocated or reserved, on its rank), and the
    uncertainty the plan claims for that kind."""
    layout = plan["layouts"][0]
    stages = layout["stages"]
    claimed = layout["margin"] if measured["kind"] == "allocated" else layout["reserved_uncertainty"]
    key = "allocated_peak" if measured["kind"] == "allocated" else "reserved_peak"
    values = [s["memory"][key] for s in stages]
    if measured["rank"] == "last":
        return values[-1], claimed
    if measured["rank"] == "first":
        return values[0], claimed
    return max(values), claimed  # "max": the largest over every GPU


FAMILIES = {"moe": ", mixture of experts", "measured-here": ", torchtitan's step on one H200 (tools/gpu_memory.py)"}


def group(case):
    """The summary a case counts in: its measured kind, and its family (experts, measured here)."""
    return case["measured"]["kind"] + FAMILIES.get(case.get("family"), "")


RUNS = {}  # results files of tools/gpu_memory.py, by path: their runs by name


def measured_run(case, root):
    """The tools/gpu_memory.py run a case names, or None for a published case."""
    m = case["measured"]
    if "from" not in m:
        return None
    if m["from"] not in RUNS:
        with open(os.path.join(root, m["from"])) as f:
            RUNS[m["from"]] = {r["name"]: r for r in json.load(f)["cases"]}
    return RUNS[m["from"]][m["case"]]


def measured_bytes(case, root):
    """The measured bytes: in the case, or in the run it names."""
    run = measured_run(case, root)
    return case["measured"]["bytes"] if run is None else run[case["measured"]["kind"] + "_peak"]


def run_case(remat, case):
    """(predicted bytes, claimed uncertainty, predicted step seconds, bytes the plan counts outside the
    allocator on each GPU) of one case."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        cmd = [remat, "plan", *case["plan"], "--top", "1", "--json", out]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{case['id']}: remat plan failed: {proc.stderr.strip()}")
        with open(out) as f:
            plan = json.load(f)
    layout = plan["layouts"][0]
    outside = sum(a["bytes"] for a in layout["outside_allocator"])
    return (*predicted(plan, case["measured"]), layout["time"]["step_s"], outside)


def gib(b):
    return f"{b / GIB:.2f} GiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--remat", required=True)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--markdown")
    ap.add_argument("--check", action="store_true", help="fail when an error exceeds the plan's claimed uncertainty")
    args = ap.parse_args()
    with open(args.cases) as f:
        data = json.load(f)
    root = os.path.dirname(os.path.dirname(os.path.abspath(args.cases)))
    rows, errors, beyond, over, times, outside = [], {}, [], [], [], []
    for case in data["cases"]:
        got, claimed, step_s, outside_planned = run_case(args.remat, case)
        run = measured_run(case, root)
        measured_s = run.get("step_s_median") if run else None
        if measured_s and case["measured"]["kind"] == "allocated":
            times.append((case, measured_s, step_s))
        if run and "outside_allocator" in run and case["measured"]["kind"] == "allocated":
            # What the GPU held beyond the allocator's segments: a plan that counts less there
            # leaves the allocator less memory than it plans for, whatever its margin claims.
            outside.append((case, run["outside_allocator"], outside_planned))
            if outside_planned < run["outside_allocator"]:
                beyond.append(f"{case['id']}: the plan counts {outside_planned} B outside the allocator, the "
                              f"GPU held {run['outside_allocator']} B there")
        want = measured_bytes(case, root)
        ratio = got / want
        errors.setdefault(group(case), []).append(abs(ratio - 1))
        rows.append((case, got, want, ratio))
        print(f"{ratio:6.3f}  {case['measured']['kind']:9s} {case['id']}", flush=True)
        if 1 - ratio > claimed:
            beyond.append(f"{case['id']}: predicted/measured {ratio:.3f}, lower than the claimed {100 * claimed:.0f}%")
        elif ratio - 1 > claimed:
            over.append(f"{case['id']}: predicted/measured {ratio:.3f}, higher than the claimed {100 * claimed:.0f}%")
    for kind, errs in errors.items():
        if errs:
            print(f"{kind}: median |error| {100 * statistics.median(errs):.1f}%, worst {100 * max(errs):.1f}%")
    for line in over:
        print(f"validate: (high, not failed) {line}", file=sys.stderr)
    if args.check:
        for line in beyond:
            print(f"validate: {line}", file=sys.stderr)
        return 1 if beyond else 0
    if not args.markdown:
        return 0

    lines = ["# Validation: plans against measured runs", "", data["about"], ""]
    lines.append("Generated by `make validate` (`tools/validate.py`); the cases, with their sources, are in "
                 "`validation/cases.json`.")
    lines.append("")
    lines.append("## Summary")
    lines.append("")
    lines.append("| measured | cases | median abs. error | worst abs. error | predicted low in |")
    lines.append("|:--|--:|--:|--:|--:|")
    for kind, errs in errors.items():
        if not errs:
            continue
        low = sum(1 for c, g, w, r in rows if group(c) == kind and r < 1)
        lines.append(f"| peak {kind} | {len(errs)} | {100 * statistics.median(errs):.1f}% | "
                     f"{100 * max(errs):.1f}% | {low} of {len(errs)} |")
    lines.append("")
    lines.append("## Cases")
    lines.append("")
    lines.append("| case | framework | GPUs | measured | kind | remat | ratio |")
    lines.append("|:--|:--|:--|--:|:--|--:|--:|")
    for case, got, want, ratio in rows:
        m = case["measured"]
        lines.append(f"| {case['id']} | {case['framework']} | {case['gpus']} | {gib(want)} | {m['kind']}, "
                     f"{m['rank']} rank | {gib(got)} | {ratio:.3f} |")
    lines.append("")
    if times:
        lines.append("## Step times")
        lines.append("")
        lines.append("The same runs' median step times against the plan's estimate (matmuls at the stated share of "
                     "the device's peak; not calibrated on these runs):")
        lines.append("")
        lines.append("| case | measured | remat | remat / measured |")
        lines.append("|:--|--:|--:|--:|")
        for case, measured_s, step_s in times:
            lines.append(f"| {case['id']} | {1e3 * measured_s:.0f} ms | {1e3 * step_s:.0f} ms | "
                         f"{step_s / measured_s:.2f} |")
        lines.append("")
    if outside:
        lines.append("## Outside the allocator")
        lines.append("")
        lines.append("What the GPU held beyond PyTorch's reserved segments after the step (`torch.cuda.mem_get_info`, "
                     "less the segments), against what the plan counts there (`remat plan`, \"per GPU ... less "
                     "what lies outside PyTorch's allocator\"); `--check` fails a plan that counts less. On one "
                     "GPU that is the CUDA context alone, whose term is taken from these runs (the same bytes in "
                     "each): the rows agree by construction and guard the term. NCCL's buffers, counted on "
                     "multi-GPU layouts, have no measurement here.")
        lines.append("")
        lines.append("| case | measured | remat | remat / measured |")
        lines.append("|:--|--:|--:|--:|")
        for case, measured_b, planned_b in outside:
            lines.append(f"| {case['id']} | {gib(measured_b)} | {gib(planned_b)} | {planned_b / measured_b:.3f} |")
        lines.append("")
    lines.append("## Sources and commands")
    lines.append("")
    for case, got, want, ratio in rows:
        s = case["source"]
        if "script" in s:
            lines.append(f"- **{case['id']}**: measured {want} B ({s['metric']}), `{s['script']}`, "
                         f"case `{s['case']}` of `{s['measured']}`.")
        else:
            lines.append(f"- **{case['id']}**: measured {want} B ({s['metric']}), "
                         f"`{s['repo']}` at `{s['commit'][:12]}`, `{s['measured']}`; configuration `{s['config']}`.")
        for note in case.get("notes", []):
            lines.append(f"  Note: {note}.")
        lines.append(f"  `remat plan {' '.join(shlex.quote(a) for a in case['plan'])}`")
    lines.append("")
    lines.append("## Published runs remat cannot express")
    lines.append("")
    for case in data.get("not_expressible", []):
        lines.append(f"- **{case['id']}** ({case['source']}): {case['why']}")
    lines.append("")
    text = "\n".join(lines)
    tmp = args.markdown + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, args.markdown)
    print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
