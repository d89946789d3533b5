"""Makes the scripts in scripts/ importable by tests (``import make_dataset``)."""
import os
import sys

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), 'scripts')
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)
