"""The model side of the engine: loading (shipped GGUFs, mlx-lm directories), supported
families, per-instance adapters onto the CPU kernels, forward passes, grammar constraints,
the fingerprint, random-weight models for tests and benchmarks."""
