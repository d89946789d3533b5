"""The iterator at ImageNet scale: construction, memory, CPU per batch."""
