"""CPU time / wall time of the per-step crop draw's kind of work (BENCHMARKS.md, "Several trainers on one
host"): torch CPU ops on a (256, 10) tensor against dres.data.crop_theta (numpy). Above 1.0 the op ran on
several intra-op threads. Usage: python benchmarks/results/h100x4-2026-11-26-session6/host_contention/cpu_probe.py"""
import resource
import time

import numpy as np
import torch

from dres.data import crop_theta


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def probe(name, f):
    for _ in range(50):
        f()
    c0, t0, k = cpu(), time.perf_counter(), 0
    while time.perf_counter() - t0 < 1.0:
        f()
        k += 1
    dt = time.perf_counter() - t0
    print(f"{name:28s} {dt / k * 1e6:8.1f} us/call  cpu/wall {(cpu() - c0) / dt:.2f}")


a = torch.rand(256, 10)
print(f"torch threads {torch.get_num_threads()}")
probe("torch.exp (256, 10)", lambda: torch.exp(a))
probe("torch.sqrt(a * a) (256, 10)", lambda: torch.sqrt(a * a))
probe("crop_theta(256), numpy", lambda: crop_theta(256, np.random.default_rng(0)))
