"""Fault injection into the iterator's local directory: the directory under
attack and under faults (``python -m chainer_prefetch_bench.local_dir_faults.run``).

Not to be confused with :mod:`chainer_prefetch_bench.fault`, the experiments
of fault-tolerant training (ULFM, checkpoint/restart).
"""
