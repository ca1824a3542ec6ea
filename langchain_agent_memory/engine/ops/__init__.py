"""The engine's floor: the mlx runtime, device defaults, CPU kernels, CUDA uploads, atomic files."""
