"""Fault injection: the local directory under attack and under faults."""
