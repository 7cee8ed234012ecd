"""The decode and cache-write operations over the kernels in `kernels/`: which kernel runs and how it is launched
(`backends.py`: the one backend table), and the torch custom ops `torch.compile` traces (`custom.py`)."""
