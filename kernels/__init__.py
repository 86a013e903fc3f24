"""Numerical kernels behind the model factory (installed as ``factory.kernels``).

What lives here:

* ``factory.kernels.ssd``: the Mamba-2 state-space-duality (SSD) scan, a
  chunked pure-PyTorch form, a sequential reference recurrence, and a lazy
  fast path through ``mamba_ssm``'s Triton kernel on CUDA.
* ``factory.kernels.mamba_ssm_triton``: the one place ``mamba_ssm``'s Triton modules
  are imported from, without its package ``__init__`` (which needs the CUDA
  extension that the no-CUDA build leaves out); ``DEVICE_TYPES`` says which tensors
  the Mamba mixer's Triton kernels serve (CUDA).
* ``factory.kernels.gated_norm`` and ``factory.kernels.causal_conv``: the Mamba
  mixer's gated RMSNorm (``mamba_ssm``'s ``rmsnorm_fn``) and depthwise causal conv
  (``factory.kernels.triton_causal_conv``, ours, with document boundaries) on CUDA,
  each with the ``*_kernel(device)`` choice the kernel report prints.
* ``factory.kernels.moe_dispatch``: token-to-expert routing and grouped expert
  MLPs without a Python loop over experts.
* ``factory.kernels.nvfp4``: NVFP4 quantize/dequantize, bit-exact to
  Transformer Engine's arithmetic, with nearest or stochastic rounding, and
  ``fake_quantize`` (the dequantized values of batched GEMM operands).
* ``factory.kernels.hadamard``: the 16x16 random Hadamard transform applied
  tile-wise to weight-gradient GEMM inputs.
* ``factory.kernels.fp8`` and ``factory.kernels.mor``: FP8 (current, delayed,
  blockwise), MXFP8, and Mixture-of-Representations selection.
* ``factory.kernels.triton_nvfp4``, ``triton_fp8`` (helpers in ``triton_tiles``):
  the NVFP4, FP8 current-scaling and MXFP8 casts as Triton kernels, bit-exact
  with the emulation; ``factory.kernels.cast_dispatch`` picks them for CUDA
  tensors (the only place they, and so Triton, are imported from).
* ``factory.kernels.tensor_parts``: the whole tensor behind a quantizer's operand
  (its amax, sums and stochastic-rounding numbers), for tensors split over ranks.

This ``__init__`` imports nothing on purpose: the submodules need torch, and
importing the package must stay free of torch so that light tools can list it.
"""
