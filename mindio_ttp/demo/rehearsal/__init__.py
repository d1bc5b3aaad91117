"""Test support for running real Megatron-LM 285068c on CPU (used by ``tests/megatron``).

* :mod:`.data`: a tiny corpus, a GPT-2-format BPE vocab/merges and a Megatron mmap indexed
  dataset, made at test time with Megatron's own tokenizer and dataset builder.
* :mod:`.tree`: a private, patchable copy of a Megatron checkout.
* :mod:`.launch`: the tiny-GPT argument set, launching ``pretrain_gpt.py`` under ``ttprun`` or
  ``torchrun`` (optionally with the CPU adaptor injected into an unpatched tree), loss parsing.
* :mod:`.checkpoints`: tensor-by-tensor bit-exact comparison of two Megatron checkpoints.
* :mod:`.runner`: ``python -m mindio_ttp.demo.rehearsal.runner TREE/pretrain_gpt.py ARGS``
  runs an unpatched entry script with the CPU adaptor installed first.

Nothing here imports Megatron into the calling process: the steps that need it run in
subprocesses, so a pytest process stays free of Megatron and of the adaptor's patches.
"""
