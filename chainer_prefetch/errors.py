"""Every exception of chainer_prefetch, under one base class.

:class:`ChainerPrefetchError` is the base of everything the package raises
on its own account, the errors of elastic training
(:class:`chainer_prefetch.elastic.errors.ElasticError`) and of fault
tolerance (:class:`chainer_prefetch.resilience.errors.ResilienceError`)
included; those two are also ``RuntimeError``.  An error raised by the
user's dataset keeps its type: ``next()`` raises an exception that is an
instance of the dataset's own exception class *and* of
:class:`ExampleLoadError`, whose message adds the example's index and files,
and whose cause (``__cause__``) carries the traceback from the loader
process (see :func:`example_load_error`).  So
``except FileNotFoundError`` works as with Chainer's ``MultiprocessIterator``
and ``except chainer_prefetch.ExampleLoadError`` catches every load failure.
"""
from typing import Optional, Sequence


class ChainerPrefetchError(Exception):
    """Base class of the exceptions chainer_prefetch raises."""


class ExampleLoadError(ChainerPrefetchError):
    """An example could not be loaded; the message names its index and files.

    Raised from ``next()`` of :class:`~chainer_prefetch.PrefetchMultiprocessIterator`
    at the position of the batch that needed the example.  When the dataset
    raised, the exception is also an instance of the dataset's exception type.

    Attributes:
        index: The example's index in the dataset (``None`` if not known).
        files: The files the example reads, as far as known.
    """

    index: Optional[int] = None
    files: Sequence[str] = ()


class WorkerDiedError(ExampleLoadError):
    """A loader process ended (killed, out of memory) without answering its tasks."""


class StagingWarning(UserWarning):
    """Staging does less than asked: some examples are read from shared storage.

    Issued once per cause by :class:`~chainer_prefetch.PrefetchMultiprocessIterator`,
    naming the dataset's class and, where there is one, the example's index
    and the file, and saying what to change (``docs/staging.rst`` lists them
    all).  ``warnings.simplefilter('error', StagingWarning)`` makes them
    errors.
    """


class StagingError(ChainerPrefetchError, OSError):
    """Base of the errors of staging files to a local directory."""


class SourceFileError(StagingError):
    """A file on shared storage could not be read (the message names it)."""


class LocalStorageError(StagingError):
    """The local directory cannot take a copy (full, read-only, no permission)."""


class UntrustedLocalDirectoryError(LocalStorageError):
    """The local directory could be written by another user (the message says how)."""


class CopyLockTimeout(StagingError):
    """Another process held a copy's lock too long (stopped?): the source is read instead."""


class ParquetColumnError(ChainerPrefetchError, KeyError):
    """A requested column is not in the files (the message lists those that are)."""

    def __str__(self):
        return str(self.args[0])


class ParquetSchemaError(ChainerPrefetchError, ValueError):
    """Two files of one dataset have different schemas (the message names both)."""


class ParquetFileError(ChainerPrefetchError, OSError):
    """A Parquet file is missing, truncated or corrupt (the message names it)."""


class RemoteTraceback(ChainerPrefetchError):
    """The traceback of an exception raised in a loader process, as text.

    Set as the ``__cause__`` of the exception that ``next()`` raises, so that
    the traceback printed in the training process shows where the loader
    process failed.
    """

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self):
        return '\n"""\n{}"""'.format(self.text)


_combined_types = {}


def _describe(index, files) -> str:
    files = ', '.join(map(str, files)) if files else 'none known'
    return 'example {} (files: {})'.format(index, files)


def _combined_type(original: type) -> Optional[type]:
    """A subclass of ``original`` and :class:`ExampleLoadError`, made once per type."""
    combined = _combined_types.get(original)
    if combined is None and original not in _combined_types:
        def __str__(self):
            return '{} [{}]'.format(original.__str__(self),
                                    _describe(self.index, self.files))

        def __reduce__(self):
            return (_rebuild, (original, self.args, self.index,
                               tuple(self.files)))

        try:
            combined = type(original.__name__, (original, ExampleLoadError),
                            {'__str__': __str__, '__reduce__': __reduce__,
                             '__module__': original.__module__})
        except TypeError:  # a final type, or incompatible layouts
            combined = None
        _combined_types[original] = combined
    return combined


def _rebuild(original: type, args: tuple, index, files):
    combined = _combined_type(original)
    error = combined.__new__(combined, *args)
    error.args = args
    error.index, error.files = index, files
    return error


def example_load_error(error: BaseException, index: Optional[int],
                       files: Sequence[str] = (),
                       remote_traceback: Optional[str] = None
                       ) -> ExampleLoadError:
    """The exception ``next()`` raises for an example that failed to load.

    Args:
        error: What loading the example raised (in a loader process).
        index: The example's index.
        files: The files it reads.
        remote_traceback: The traceback text from the loader process.

    Returns:
        An exception of a subclass of both ``type(error)`` and
        :class:`ExampleLoadError` with the same ``args`` and attributes,
        whose message adds the index and files; when ``type(error)`` cannot
        be subclassed, an :class:`ExampleLoadError` saying what it was.
        Its ``__cause__`` is a :class:`RemoteTraceback` when given, else
        ``error``.
    """
    combined = None
    if isinstance(error, ExampleLoadError):
        combined = error
    else:
        cls = _combined_type(type(error))
        if cls is not None:
            try:
                combined = cls.__new__(cls, *error.args)
                combined.args = error.args
                combined.__dict__.update(getattr(error, '__dict__', {}))
                if isinstance(error, OSError):  # kept outside args
                    # (set only when there: OSError's message shows any set)
                    for name in ('filename', 'filename2'):
                        if getattr(error, name) is not None:
                            setattr(combined, name, getattr(error, name))
            except Exception:  # an exception type with an unusual __new__
                combined = None
    if combined is None:
        combined = ExampleLoadError('{}: {}: {}'.format(
            _describe(index, files), type(error).__name__, error))
    combined.index = index
    combined.files = tuple(files)
    cause = RemoteTraceback(remote_traceback) if remote_traceback else error
    if cause is not combined:
        combined.__cause__ = cause
    return combined

