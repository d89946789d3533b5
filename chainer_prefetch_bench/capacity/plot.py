#!/usr/bin/env python
"""Figures and table of the capacity benchmark (``capacity.bench``).

Usage::

    python -m chainer_prefetch_bench.capacity.plot results/capacity/capacity.json \\
        --out results/capacity

Writes ``fig_capacity.png`` (per policy, against the limit: bytes read from
shared storage per epoch in steady state with the ideal ``1 - limit``, the
share of stage-3 reads served locally, and the epoch time),
``fig_capacity_epochs.png`` (bytes from shared storage epoch by epoch),
``fig_next_epoch_cache.png`` (time to the first minibatches of each epoch,
with and without the next-epoch cache) and ``table.txt`` (the benchmark's
printed tables).
"""
import argparse
import contextlib
import io
import json
import os
import sys

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402

from chainer_prefetch_bench.capacity import bench  # noqa: E402
from chainer_prefetch_bench.testbed.report import save_figure  # noqa: E402

COLOURS = {'belady': 'tab:green', 'lru': 'tab:red', 'fill_once': 'tab:blue'}
LABELS = {'belady': 'Belady + look-ahead (ours)', 'lru': 'LRU',
          'fill_once': 'fill once (MinIO)'}


def capacity_runs(report):
    return [run for run in report['runs']
            if run['config']['kind'] == 'capacity']


def plot_capacity(report, out):
    runs = capacity_runs(report)
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for policy in bench.POLICIES:
        mine = sorted((run for run in runs
                       if run['config']['policy'] == policy),
                      key=lambda run: run['config']['fraction'])
        if not mine:
            continue
        limits = [100 * run['config']['fraction'] for run in mine]
        style = dict(marker='o', color=COLOURS[policy], label=LABELS[policy],
                     linewidth=3 if policy == 'belady' else 1.5,
                     zorder=3 if policy == 'belady' else 2)
        axes[0].plot(limits, [100 * bench.steady(
            run, 'shared_fraction') for run in mine], **style)
        axes[1].plot(limits, [100 * bench.steady(
            run, 'local_share') for run in mine], **style)
        axes[2].plot(limits, [bench.steady(run, 'seconds')
                              for run in mine], **style)
    limits = sorted({100 * run['config']['fraction'] for run in runs})
    axes[0].plot(limits, [100 - limit for limit in limits], 'k--',
                 label='minimum: 100% - limit')
    axes[0].set_ylabel('read from shared storage per epoch (% of dataset)')
    axes[1].set_ylabel('stage-3 reads from local copies (%)')
    axes[2].set_ylabel('epoch time (s)')
    for axis in axes:
        axis.set_xlabel('local directory limit (% of dataset)')
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle('Steady state (epochs 2+), {} images, {} preset'.format(
        report['n_images'], report['preset']))
    save_figure(figure, out, 'fig_capacity.png', dpi=110)


def plot_epochs(report, out):
    runs = capacity_runs(report)
    fractions = sorted({run['config']['fraction'] for run in runs})
    figure, axes = plt.subplots(1, len(fractions), sharey=True,
                                figsize=(4 * len(fractions), 3.6))
    axes = axes if len(fractions) > 1 else [axes]
    for axis, fraction in zip(axes, fractions):
        for run in runs:
            config = run['config']
            if config['fraction'] != fraction:
                continue
            axis.plot([100 * row['shared_fraction'] for row in run['epochs']],
                      marker='o', color=COLOURS[config['policy']],
                      label=LABELS[config['policy']])
        axis.axhline(100 * (1 - fraction), color='k', linestyle='--')
        axis.set_title('limit {:.0f}%'.format(100 * fraction))
        axis.set_xlabel('epoch')
        axis.grid(alpha=0.3)
    axes[0].set_ylabel('read from shared storage (% of dataset)')
    axes[0].legend(fontsize=8)
    save_figure(figure, out, 'fig_capacity_epochs.png', dpi=110)


def plot_cache(report, out):
    runs = [run for run in report['runs'] if run['config']['kind'] == 'cache']
    if not runs:
        return
    figure, axis = plt.subplots(figsize=(6.5, 4))
    for run in runs:
        config = run['config']
        name = ('no local directory' if config['fraction'] is None else
                'local limit {:.0f}%'.format(100 * config['fraction']))
        cache = config['cache_examples']
        axis.plot([row['first_batches_s'] for row in run['epochs']],
                  marker='o', linestyle='-' if cache else ':',
                  label='{}, cache {}'.format(name, cache or 'off'))
    axis.set_xlabel('epoch')
    axis.set_ylabel('time to the first {} minibatches (s)'.format(
        bench.FIRST_BATCHES))
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    save_figure(figure, out, 'fig_next_epoch_cache.png', dpi=110)


def write_table(report, out):
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print(report['command'])
        print('{n_images} images ({dataset_bytes} bytes), batch {batch_size}, '
              'preset {preset}'.format(**report))
        bench.print_capacity_table(report['runs'])
        bench.print_cache_table(report['runs'])
    with open(os.path.join(out, 'table.txt'), 'w') as table:
        table.write(text.getvalue())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('report')
    parser.add_argument('--out', default=None,
                        help='folder (default: the report\'s folder)')
    args = parser.parse_args(argv)
    with open(args.report) as source:
        report = json.load(source)
    out = args.out or os.path.dirname(os.path.abspath(args.report))
    os.makedirs(out, exist_ok=True)
    plot_capacity(report, out)
    plot_epochs(report, out)
    plot_cache(report, out)
    write_table(report, out)
    print('wrote figures and table.txt into ' + out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
