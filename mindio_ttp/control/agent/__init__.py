"""The node agent: one per node, between the node's ranks and the controller (node.py); how it
goes up (uplink.py); a rank's side of it (client.py); its process when no launcher runs one
(process.py). docs/design.md, "The control plane in tiers"."""
