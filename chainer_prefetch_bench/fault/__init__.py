"""Fault-tolerance experiments: recovery time, checkpoint cost, learning curves."""
