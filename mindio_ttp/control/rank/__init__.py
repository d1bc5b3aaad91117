"""A rank's side of the control plane.

`processor.py` is the thread beside training that heartbeats and obeys orders (it runs the
save and rename handlers through mindio_ttp/handlers.py), `failover.py` how it finds a standby
controller, `release.py` the fault-time stop of the training thread, `authstore.py` the store
the savers meet through and `calls.py` its calls in flight, `preemption.py` SIGTERM, `state.py`
the processor's life cycle as a table. What a rank asks of its node's launcher (a replacement,
its exit record) goes through the desk the API face hands the processor (launch/desk.py):
nothing here writes a launcher's files.
"""
