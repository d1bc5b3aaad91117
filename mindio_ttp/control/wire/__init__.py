"""What the tiers of the control plane say to each other (docs/design.md, "The control plane in
tiers"): the keys each tier holds (`keys`), the end-to-end sealed orders (`envelope`) and the
messages between ranks, node agents, relays and the controller (`tier`). No I/O here."""
