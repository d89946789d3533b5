"""A local directory smaller than the dataset (eviction policies), and the next-epoch cache."""
