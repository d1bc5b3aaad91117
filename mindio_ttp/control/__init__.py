"""The control plane, one package per tier; imports run down this list, never up
(tests/test_layers.py):

* `rank/`: a rank's side: the processor thread beside training, its failover, the save handlers
  it runs, the fault-time stop, the store the savers meet through;
* `controller/`: the one process that decides: the selector loop, a fault's flow, selection and
  the recovery plan, the routes down to agents and relays;
* `agent/`: one per node, between the node's ranks and the controller;
* `relay/`: a node agent serving other node agents (the third tier at 10k+ nodes);
* `wire/`: what every tier shares: the frame protocol, the authenticated transport and
  handshake, admission before authentication, the liveness clock, rank sets, the tiers' keys
  and sealed envelopes.
"""
