"""ttprun: torchrun with an agent that keeps survivors up for the dying checkpoint."""
