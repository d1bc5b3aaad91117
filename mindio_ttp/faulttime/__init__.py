"""What runs after a fault on the ranks that save: device binding and reads, the save session,
the fault claim, the one checkpoint writer, and the collective settings that keep survivors up."""
