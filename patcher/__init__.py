"""ttp-patch: the MindIO TTP guide's Megatron-LM 285068c edits as checked, reversible codemods."""

from mindio_ttp import __version__

__all__ = ["__version__"]
