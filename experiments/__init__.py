"""Experiments: the reproduction of the papers' claims at CIFAR scale (repro) and its records."""
