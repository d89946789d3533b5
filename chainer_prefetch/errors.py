"""Exceptions that reach the user of the iterators."""


class ExampleLoadError(RuntimeError):
    """An example could not be loaded; the message names its index and files.

    Raised from ``next()`` of :class:`~chainer_prefetch.PrefetchMultiprocessIterator`
    at the position of the batch that needed the example.  The message carries
    the original exception's type, text and traceback from the worker process.
    """
