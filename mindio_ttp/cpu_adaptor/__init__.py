"""CPU adaptor: run Megatron-LM 285068c unmodified on a CPU-only machine with gloo.

``import mindio_ttp.cpu_adaptor`` installs everything (like ``megatron_npu`` on Ascend);
``ttp-patch apply --device cpu`` puts that import in ``pretrain_gpt.py`` right after
``import torch`` and ``import mindio_ttp.compat`` (the torch/numpy drift fixes every device
gets; the adaptor installs them too when they are not yet in place, for unpatched trees). It
must come before any ``megatron`` import, else it raises :class:`CPUAdaptorError` without
changing anything. Importing it again is a no-op. It holds only what a CPU needs: a tree
patched for ``--device cuda`` is this tree minus this one import.

What it patches, by module (each module's docstring gives the Megatron file:line it serves):

========================  =====================================================================
``cpu_torch``             DDP without ``device_ids``; private DataLoader generator for
                          Megatron; process groups destroyed at exit (gloo)
``gloo_collectives``      ``_all_gather_base`` / ``_reduce_scatter_base`` for Megatron on a
                          gloo without them (torch 2.1)
``cuda_on_cpu``           ``torch.cuda`` device/RNG/memory calls, typed-tensor classes,
                          ``Tensor.cuda``/``Module.cuda`` identity, ``Tensor.type()`` names
``apex_standins``         ``apex.optimizers.FusedAdam/FusedSGD``, ``multi_tensor_applier``,
                          ``amp_C.multi_tensor_l2norm/scale``
``layer_norm``            ``fused_mix_prec_layer_norm_cuda`` on ATen's layer norm
``megatron_hooks``        post-import hooks: ``fused_kernels.load``, ``set_jit_fusion_options``,
                          ``_set_cuda_rng_state``, ``compile_helper`` (+ out-of-tree
                          ``helpers`` build), ``knn_monitor`` stub
(here)                    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` unless set (``arguments.py:337-345``)
========================  =====================================================================

Patches that change an answer other code relies on are scoped to Megatron's own calls
(:mod:`mindio_ttp.compat.scope`); the launcher, the TTP runtime and tests in the same process
see stock torch.
Megatron still needs ``--distributed-backend gloo`` and the CUDA fusions off
(``--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion
--no-gradient-accumulation-fusion``).
"""

from ._install import CPUAdaptorError, install, is_installed, uninstall

__all__ = ["CPUAdaptorError", "install", "is_installed", "uninstall"]

install()
