"""Parquet loaders side by side: ours, Petastorm (in its own environment), a per-worker cache."""
