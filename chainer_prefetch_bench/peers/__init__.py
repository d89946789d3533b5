"""The peer tier on simulated nodes: bytes from shared storage and epoch times."""
