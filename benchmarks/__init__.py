"""dres benchmarks: kernel microbenchmarks (bench_kernels), end-to-end training throughput
(bench_train) and the plain-PyTorch baselines they compare against (baselines). See BENCHMARKS.md."""
