"""Triton kernels of quantmla_hf, each beside its plain PyTorch reference (`*_ref.py`).

Installed as `quantmla_hf.kernels` (never as a top-level `kernels` module, a name owned by Hugging Face's
kernel-hub package).
"""
