"""What every tier of the control plane shares (docs/design.md, "The control plane in tiers"):
the frame format (`protocol`), non-blocking framed connections (`transport`), the handshake and
session keys (`session`), who may wait for a handshake (`admission`), the clock a peer's silence
is measured on (`liveness`), rank lists in O(1) bytes (`ranksets`), the keys each tier holds
(`keys`), the end-to-end sealed orders (`envelope`) and the messages between ranks, node agents,
relays and the controller (`tier`)."""
