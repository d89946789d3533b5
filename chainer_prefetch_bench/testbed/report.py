"""Writing results: JSON files (atomically) and figures."""
import json
import os
from typing import Any, List, Optional


def write_json(path: str, data: Any, indent: int = 1) -> str:
    """Write ``data`` to ``path`` as JSON, atomically; make its folder.

    A reader (or a run killed mid-write) never sees half a file: the JSON
    goes to ``path.partial`` first, which is then renamed.

    Args:
        path: The file to write.
        data: JSON-able data.
        indent: JSON indentation.

    Returns:
        ``path``.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    partial = path + '.partial'
    with open(partial, 'w') as f:
        json.dump(data, f, indent=indent)
    os.replace(partial, path)
    return path


def write_results(out: str, module: str, argv: List[str], runs: List[Any],
                  table: str, **context: Any):
    """Writes a script's runs to ``out/<script>.json`` and ``out/table.txt``.

    ``table.txt`` starts with the command that produced it.

    Args:
        out: The results folder (made if missing).
        module: The script's module (``python -m`` runs it).
        argv: Its arguments.
        runs: JSON-able runs.
        table: The table to show.
        context: More JSON-able fields for the JSON file (the machine).
    """
    write_json(os.path.join(out, module.rsplit('.', 1)[-1] + '.json'),
               dict(context, argv=argv, runs=runs))
    with open(os.path.join(out, 'table.txt'), 'w') as table_file:
        table_file.write('python -m {} {}\n\n{}\n'.format(
            module, ' '.join(argv), table))


def show_results(out: Optional[str], module: str, argv: List[str], runs: List[Any],
                 table: str, **context: Any) -> None:
    """Prints a script's table, and writes its results where ``out`` is given.

    Args:
        out: The results folder (see :func:`write_results`), or ``None``.
        module: The script's module.
        argv: Its arguments.
        runs: JSON-able runs.
        table: The table.
        context: More JSON-able fields for the JSON file.
    """
    print(table)
    if out:
        write_results(out, module, argv, runs, table, **context)


def save_figure(fig, out: str, name: str, dpi: int = 120) -> str:
    """Lay out ``fig``, write it to ``out/name`` and close it.

    Args:
        fig: A matplotlib figure.
        out: Folder (made if missing).
        name: File name (its extension picks the format).
        dpi: Resolution.

    Returns:
        The path written.
    """
    import matplotlib.pyplot as plt
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
