"""The controller tier: the one process that decides.

`server.py` is the selector loop every agent and rank registers with, `flow.py` a fault's flow
in its own thread, `selection.py` and `recovery_plan.py` the pure decisions it makes,
`routes.py` its routes down through agents and relays, `host.py` the controller in a process of
its own.
"""
