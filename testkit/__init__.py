"""The test rig shared by tests/ and bench/: import hooks, network namespaces, fault and audit
hooks for child processes. Never installed (setup.cfg packages only patcher and mindio_ttp)."""
