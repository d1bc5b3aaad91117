"""Open runtime behind the MindIO TTP hooks that `ttp-patch` inserts into Megatron-LM.

Submodules are imported on demand: `framework_ttp` needs only torch, `megatron_ttp`
needs Megatron-LM on the path, so importing this package must stay cheap.
"""

__version__ = "0.1.0"
