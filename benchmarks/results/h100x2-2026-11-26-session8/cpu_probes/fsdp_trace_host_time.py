# CPU time per step in FSDP2's hooks (FSDP::* ranges) and in Optimizer.step, summed from the Chrome traces of
# `profile_train --bench mae --models timm,dres_official --mode eager --dist none,fsdp --trace` (session 8, call 2).
# Run from the repository root: python benchmarks/results/h100x2-2026-11-26-session8/cpu_probes/fsdp_trace_host_time.py
import collections, glob, gzip, json
for f in sorted(glob.glob("benchmarks/results/h100-2026-11-26-session8/b/prof/trace-*.json.gz")):
    ev = json.load(gzip.open(f))["traceEvents"]
    spans = [e for e in ev if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    steps = sum(e["name"].startswith("Optimizer.step") for e in spans)
    ms = collections.Counter()
    for e in spans:
        if e["name"].startswith("FSDP::"):
            ms["FSDP hooks"] += e["dur"] / 1e3 / steps
        elif e["name"].startswith("Optimizer.step"):
            ms["optimizer"] += e["dur"] / 1e3 / steps
    print(f.split("trace-")[1], "steps", steps, {k: round(v, 1) for k, v in ms.items()})
