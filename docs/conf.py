"""Sphinx configuration of the chainer_prefetch documentation.

Build (from the repository root; warnings are errors, as in CI)::

    bash scripts/run.sh docs
"""
import os
import sys

sys.path.insert(0, os.path.abspath('..'))

import chainer_prefetch  # noqa: E402

project = 'chainer_prefetch'
author = 'chainer_prefetch contributors'
copyright = '2026, ' + author
release = chainer_prefetch.__version__
version = release

extensions = [
    'sphinx.ext.autodoc',
    'sphinx.ext.napoleon',
    'sphinx.ext.viewcode',
]

# The docstrings are Google style (Args:, Returns:, Raises:, Attributes:).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True

autodoc_member_order = 'bysource'
autodoc_typehints = 'description'
autodoc_inherit_docstrings = False

exclude_patterns = ['_build']
templates_path = []
html_static_path = []
html_theme = 'furo'
html_title = 'chainer_prefetch ' + release
