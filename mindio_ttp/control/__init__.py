"""The control plane: the controller (one selector thread), the per-rank processor, the
wire protocol and its authenticated transport, and the dying-checkpoint flow."""
