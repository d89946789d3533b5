"""Elastic training experiments: fixed sizes, growth, shrinkage, re-split reads."""
