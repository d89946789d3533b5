#!/usr/bin/env python
"""Figures of the fault-tolerance experiments (``fault.run``).

Usage::

    python -m chainer_prefetch_bench.fault.plot --results results/fault

Reads ``recovery.json``, ``checkpoint_cost.json`` and ``curves.json`` and
writes ``fig5_recovery_time.png`` (back in the loop and progress regained
per strategy and number of ranks: median bar, every run as a dot, log
scale), ``fig6_checkpoint_cost.png`` (one snapshot's cost in parts),
``fig7_curves_wall_time.png`` (validation error against wall time, every
run, failures marked) and ``fig8_curves_iteration.png`` (the same against
the iteration).
"""
import argparse
import json
import os
import statistics
import sys
from typing import Optional, Sequence

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402

STRATEGIES = ('respawn-spares', 'respawn', 'shrink', 'checkpoint')
COLOURS = {'respawn-spares': 'tab:blue', 'respawn': 'tab:cyan',
           'shrink': 'tab:green', 'checkpoint': 'tab:red',
           'no failure': 'tab:gray'}


def plot_recovery(records, path):
    sizes = sorted({r['ranks'] for r in records})
    width = 0.8 / len(STRATEGIES)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, key, title in ((axes[0], 'back_s', 'Kill to back in the loop'),
                           (axes[1], 'regain_s',
                            'Kill to progress regained')):
        for i, strategy in enumerate(STRATEGIES):
            for j, n in enumerate(sizes):
                times = [r[key] for r in records
                         if r['strategy'] == strategy and r['ranks'] == n]
                if not times:
                    continue
                x = j + (i - (len(STRATEGIES) - 1) / 2) * width
                ax.bar(x, statistics.median(times), width,
                       color=COLOURS[strategy],
                       label=strategy if j == 0 else None)
                ax.plot([x] * len(times), times, 'k.', markersize=3)
        ax.set_yscale('log')
        ax.set_xticks(range(len(sizes)))
        ax.set_xticklabels(['{} ranks'.format(n) for n in sizes])
        ax.set_title(title)
    axes[0].set_ylabel('seconds (log scale)')
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_checkpoint_cost(records, path):
    parts = ('serialize_s', 'compress_s', 'write_s', 'fsync_s')
    archs = sorted({r['arch'] for r in records}, key=lambda a: a != 'tiny')
    fig, axes = plt.subplots(1, len(archs), figsize=(3 * len(archs), 3.5))
    for ax, arch in zip(axes, archs):
        rows = [r for r in records if r['arch'] == arch]
        bottom = 0.0
        for part in parts:
            value = statistics.median(r[part] for r in rows)
            ax.bar(0, value, 0.5, bottom=bottom, label=part[:-2])
            bottom += value
        ax.bar(1, statistics.median(r['load_s'] for r in rows), 0.5,
               color='tab:gray', label='load')
        ax.set_xticks([0, 1])
        ax.set_xticklabels(['save', 'load'])
        ax.set_title('{} ({:.1f} MB)'.format(arch, rows[0]['bytes'] / 1e6))
        ax.set_ylabel('seconds')
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curves(curves, path, x_index, xlabel):
    fig, ax = plt.subplots(figsize=(7, 4))
    labelled = set()
    for run in curves['runs']:
        points = run['validation']
        label = run['label']
        ax.plot([p[x_index] for p in points], [p[1] for p in points],
                '.-', color=COLOURS[label], linewidth=1, markersize=3,
                label=None if label in labelled else label)
        labelled.add(label)
        if x_index == 0 and run['failure_s'] is not None:
            ax.axvline(run['failure_s'], color=COLOURS[label],
                       linestyle=':', linewidth=0.8)
    if x_index == 0:
        for t in curves['wall_times']:
            ax.axvline(t, color='k', linewidth=0.5)
    ax.set_xlabel(xlabel)
    ax.set_ylabel('validation error')
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load(directory, name):
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--results', default=os.path.join('results', 'fault'),
                        help='folder of the JSON files; the figures go there')
    args = parser.parse_args(argv)
    out = args.results
    recovery = load(out, 'recovery.json')
    if recovery:
        plot_recovery(recovery, os.path.join(out, 'fig5_recovery_time.png'))
    cost = load(out, 'checkpoint_cost.json')
    if cost:
        plot_checkpoint_cost(cost, os.path.join(out,
                                                'fig6_checkpoint_cost.png'))
    curves = load(out, 'curves.json')
    if curves:
        plot_curves(curves, os.path.join(out, 'fig7_curves_wall_time.png'),
                    0, 'wall time since launch (s)')
        plot_curves(curves, os.path.join(out, 'fig8_curves_iteration.png'),
                    2, 'iteration')
    return 0


if __name__ == '__main__':
    sys.exit(main())
