import json, os, statistics, sys
name, run = sys.argv[1], sys.argv[2]
try:
    r = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
except FileNotFoundError:
    print(f"RATE {name}: no metrics"); sys.exit(0)
ips = [x["img_per_s"] for x in r]
steady = ips[2:] or ips
print(f"RATE {name}: steady img/s median {statistics.median(steady):.0f} (windows {[round(x) for x in ips]})")
with open(os.path.join(os.environ["OUT"], "rates.jsonl"), "a") as f:
    f.write(json.dumps({"name": name, "img_per_s_windows": ips, "steady_median": statistics.median(steady)}) + "\n")
