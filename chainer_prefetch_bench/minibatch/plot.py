#!/usr/bin/env python
"""Figures 4-6 and Table 2 of the source paper, from the minibatch benchmark's JSON.

Usage::

    python -m chainer_prefetch_bench.minibatch.plot results/minibatch/sweep.json \\
        --out results/minibatch

Writes ``fig4_time_vs_processes.png``, ``fig5_cumulative.png``,
``fig6_copy_threads.png`` (when the JSON has a copy-thread sweep) and
``table2.txt``, and prints Table 2.  Medians over repetitions.  The paper's
numbers (1,000 minibatches of ImageNet on a Cygnus node with Lustre) stand
beside ours as ratios to baseline+SSD, since absolute times of different
machines and dataset sizes do not compare.
"""
import argparse
import json
import os
import statistics
import sys

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402

from chainer_prefetch_bench.testbed.report import save_figure  # noqa: E402

#: Table 2 of the paper (2 minibatch processes): first minibatch s, total s.
PAPER_TABLE2 = {'baseline-local': (4.38, 59.49),
                'baseline-remote': (4.77, 480.85),
                'proposed-cold': (10.12, 400.88)}
PAPER_NAMES = {'baseline-local': 'baseline+SSD',
               'baseline-remote': 'baseline+Lustre',
               'proposed-cold': 'proposed'}
STYLE = {'baseline-local': ('tab:green', 'o'),
         'baseline-remote': ('tab:red', 's'),
         'proposed-cold': ('tab:blue', '^'),
         'proposed-cold-user': ('tab:pink', '<'),
         'proposed-learned': ('tab:orange', '>'),
         'proposed-warm': ('tab:cyan', 'v'),
         'prefetch-local': ('tab:gray', '*'),
         'copy-then-local': ('tab:olive', 'D'),
         'multithread': ('tab:purple', 'x'),
         'torch': ('tab:brown', '+')}


def load(path):
    with open(path) as source:
        return json.load(source)


def main_runs(report):
    """Runs of the main comparison (proposed at the default copy threads)."""
    threads = _default_copy_threads(report)
    return [run for run in report['runs']
            if not run['method'].startswith('proposed')
            or run['n_copy_threads'] == threads]


def _default_copy_threads(report):
    counts = {}
    for run in report['runs']:
        if run['method'] == 'proposed-warm':
            return run['n_copy_threads']
        if run['method'] == 'proposed-cold':
            counts[run['n_copy_threads']] = counts.get(
                run['n_copy_threads'], 0) + 1
    return max(counts, key=counts.get) if counts else None


def median_by(runs, *keys, value='total_s'):
    groups = {}
    for run in runs:
        groups.setdefault(tuple(run[key] for key in keys), []).append(
            run[value])
    return {key: statistics.median(values) for key, values in groups.items()}


def figure4(report, out):
    totals = median_by(main_runs(report), 'method', 'n_processes')
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method in STYLE:
        points = sorted((n, t) for (m, n), t in totals.items() if m == method)
        if points:
            colour, marker = STYLE[method]
            ax.plot(*zip(*points), marker=marker, color=colour, label=method)
    ax.set_xscale('log', base=2)
    ax.set_xticks(sorted({n for _, n in totals}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel('minibatch processes')
    ax.set_ylabel('seconds for {} minibatches'.format(
        report['runs'][0]['n_batches']))
    ax.set_title('Fig. 4: time to load minibatches ({} storage)'.format(
        report['preset']))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, out, 'fig4_time_vs_processes.png')




def figure5(report, out, n_processes=2):
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method in STYLE:
        runs = [run for run in main_runs(report) if run['method'] == method
                and run['n_processes'] == n_processes]
        if not runs:
            continue
        curve = [statistics.median(values)
                 for values in zip(*(run['cumulative_s'] for run in runs))]
        colour, _ = STYLE[method]
        ax.plot(range(1, len(curve) + 1), curve, color=colour, label=method)
    ax.set_xlabel('minibatches loaded')
    ax.set_ylabel('cumulative seconds')
    ax.set_title('Fig. 5: cumulative time, {} processes'.format(n_processes))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, out, 'fig5_cumulative.png')


def figure6(report, out, n_processes=2):
    sweep = median_by([run for run in report['runs']
                       if run['method'] == 'proposed-cold'
                       and run['n_processes'] == n_processes],
                      'n_copy_threads')
    if len(sweep) < 2:
        return None
    baselines = median_by([run for run in main_runs(report)
                           if run['n_processes'] == n_processes], 'method')
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    points = sorted((threads, total) for (threads,), total in sweep.items())
    ax.plot(*zip(*points), marker='^', color=STYLE['proposed-cold'][0],
            label='proposed-cold')
    for method in ('baseline-local', 'baseline-remote'):
        if (method,) in baselines:
            ax.axhline(baselines[(method,)], color=STYLE[method][0],
                       linestyle='--', label=method)
    ax.set_xlabel('copy threads (stage 2)')
    ax.set_ylabel('seconds')
    ax.set_title('Fig. 6: copy threads, {} minibatch processes'.format(
        n_processes))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, out, 'fig6_copy_threads.png')


def table2(report, n_processes=2):
    """Table 2 as text: first minibatch and total, ours and the paper's."""
    runs = [run for run in main_runs(report)
            if run['n_processes'] == n_processes]
    totals = median_by(runs, 'method')
    firsts = median_by(runs, 'method', value='first_batch_s')
    local = totals.get(('baseline-local',))
    paper_local = PAPER_TABLE2['baseline-local'][1]
    lines = ['Table 2: {} minibatches of {} images, {} processes, {} '
             'storage (medians of {} repetition(s))'.format(
                 report['runs'][0]['n_batches'], report['batch_size'],
                 n_processes, report['preset'],
                 max(run['repeat'] for run in runs) + 1),
             '{:<16} {:>12} {:>10} {:>10} | {:>16} {:>10} {:>10}'.format(
                 'method', 'first batch', 'total s', 'vs local', 'paper',
                 'total s', 'vs SSD')]
    for method in STYLE:
        if (method,) not in totals:
            continue
        total = totals[(method,)]
        paper = PAPER_TABLE2.get(method)
        paper_text = ('{:>16} {:>10.2f} {:>9.2f}x'.format(
            PAPER_NAMES[method], paper[1], paper[1] / paper_local)
            if paper else '{:>16} {:>10} {:>10}'.format('', '', ''))
        lines.append('{:<16} {:>12.3f} {:>10.2f} {:>9.2f}x | {}'.format(
            method, firsts[(method,)], total,
            total / local if local else float('nan'), paper_text))
    return '\n'.join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('json', help='output of chainer_prefetch_bench.minibatch.bench')
    parser.add_argument('--out', default='results',
                        help='folder for the PNG files and table2.txt')
    args = parser.parse_args(argv)
    report = load(args.json)
    os.makedirs(args.out, exist_ok=True)
    written = [figure4(report, args.out), figure5(report, args.out),
               figure6(report, args.out)]
    text = table2(report)
    table_path = os.path.join(args.out, 'table2.txt')
    with open(table_path, 'w') as table:
        table.write(text + '\n')
    print(text)
    for path in written + [table_path]:
        if path:
            print('wrote ' + path)
    return 0


if __name__ == '__main__':
    sys.exit(main())
