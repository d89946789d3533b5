#!/usr/bin/env python
"""Figures 7-11, Table 4 and Tables A.1-A.3 of the training experiment (``training.run``).

Usage::

    python -m chainer_prefetch_bench.training.plot results/training/raw.json \\
        --out results/training

Writes into ``--out``:

* ``fig7_total_time.png``: wall time of each run (``mpiexec`` start to
  exit) per process count K and method;
* ``fig8_total_with_copy.png``: the same, with the measured parallel copy
  time of the dataset (Table 3) stacked on baseline-local;
* ``fig9_breakdown_baseline-local.png``, ``fig10_breakdown_baseline-remote
  .png``, ``fig11_breakdown_proposed.png``: per-epoch stacked bars of
  allreduce / backward / forward / load / other at the largest K, mean
  over ranks (same y scale);
* ``table4.txt``: first- and second-iteration load time and epoch-1 load
  per method;
* ``tableA.txt``: Tables A.1-A.3, total time, iterations, iterations/s and
  estimated MiB/s per K and method, with the paper's 1-node (4-process)
  values as ratios to baseline-local;
* ``targets.txt``: the targets summary.

Everything printed goes to stdout too.  The paper's absolute times (ResNet-50
on V100s, 1.26 M ImageNet files on Lustre) do not compare with ours, so they
appear as ratios to baseline-local (baseline+SSD).
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

METHODS = ('baseline-local', 'baseline-remote', 'proposed')
PAPER_NAMES = {'baseline-local': 'baseline+SSD',
               'baseline-remote': 'baseline+Lustre',
               'proposed': 'proposed'}
COLOURS = {'baseline-local': 'tab:green', 'baseline-remote': 'tab:red',
           'proposed': 'tab:blue'}
COMPONENTS = ('load', 'forward', 'backward', 'allreduce', 'other')
STACK = ('allreduce', 'backward', 'forward', 'load', 'other')
"""Bottom to top, as the paper's Figs. 9-11 list them."""
COMPONENT_COLOURS = {'allreduce': 'tab:purple', 'backward': 'tab:orange',
                     'forward': 'tab:olive', 'load': 'tab:red',
                     'other': 'tab:gray'}

# The paper's numbers (Cygnus, ResNet-50, 10 epochs of ImageNet).
PAPER_TOTAL_1NODE = {'baseline-local': 14339.98,
                     'baseline-remote': 45586.36,
                     'proposed': 15878.37}
"""Tables A.1-A.3, 1 node = 4 processes: total seconds."""
PAPER_ITERATIONS_1NODE = 98532
PAPER_TABLE4_FIRST_LOAD = {'baseline-local': 334.55,
                           'baseline-remote': 289.92,
                           'proposed': 683.31}
"""Table 4 (16 nodes, 64 processes): first iteration's load, seconds."""
PAPER_OTHER_SHARE = {'baseline-local': (0.43, 0.43),
                     'baseline-remote': (0.43, 0.43),
                     'proposed': (0.63, 0.71)}
"""Sec. 4.4: share of "other" in an epoch (range)."""
PAPER_PROCS = 4  # one node

TARGET_EPOCH1 = 1.2
TARGET_FIRST_LOAD = 1.0


def load(path):
    with open(path) as f:
        return json.load(f)


def good_runs(data):
    """Runs that finished and left a breakdown for every rank."""
    return [run for run in data['runs']
            if run['returncode'] == 0 and not run.get('timed_out')
            and len(run['breakdown']) == run['procs']]


def by_key(runs):
    return {(run['method'], run['procs']): run for run in runs}


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def epoch_means(run):
    """Per-epoch component sums, wall and iterations, mean over ranks."""
    n_epochs = min(len(b['epochs']) for b in run['breakdown'])
    epochs = []
    for i in range(n_epochs):
        records = [b['epochs'][i] for b in run['breakdown']]
        epochs.append({key: _mean([r[key] for r in records])
                       for key in COMPONENTS + ('wall', 'iterations')})
        epochs[-1]['epoch'] = records[0]['epoch']
    return epochs


def other_share(run):
    epochs = epoch_means(run)
    wall = sum(e['wall'] for e in epochs)
    return sum(e['other'] for e in epochs) / wall if wall else None


def first_loads(run):
    first = [b['first_iteration_load'] for b in run['breakdown']]
    second = [b['second_iteration_load'] for b in run['breakdown']]
    return _mean(first), max(v for v in first if v is not None), _mean(second)


def iterations(run):
    return run['breakdown'][0]['totals']['iterations']


def train_seconds(run):
    """Rank 0's time from its first iteration's start to its last's end."""
    return run['breakdown'][0]['totals']['wall']


def bytes_per_iteration(data, run):
    mean_bytes = data['dataset'].get('train_mean_bytes')
    if not mean_bytes:
        return None
    return mean_bytes * data['config']['batchsize'] * run['procs']


def _ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def _fmt(value, spec='.2f', none='-'):
    return none if value is None else format(value, spec)


def _procs_list(runs):
    return sorted({run['procs'] for run in runs})


def _largest_complete_k(runs):
    keys = by_key(runs)
    complete = [k for k in _procs_list(runs)
                if all((m, k) in keys for m in METHODS)]
    if complete:
        return complete[-1]
    procs = _procs_list(runs)
    return procs[-1] if procs else None


# ---------------------------------------------------------------- figures


def _grouped_bars(ax, runs, copy_seconds=None, copy_ways=8):
    keys = by_key(runs)
    procs = _procs_list(runs)
    width = 0.8 / len(METHODS)
    for j, method in enumerate(METHODS):
        xs, heights, copies = [], [], []
        for i, k in enumerate(procs):
            run = keys.get((method, k))
            if run is None:
                continue
            xs.append(i + (j - (len(METHODS) - 1) / 2) * width)
            heights.append(run['wall_seconds'])
        if not xs:
            continue
        ax.bar(xs, heights, width, color=COLOURS[method],
               label='{} (paper: {})'.format(method, PAPER_NAMES[method]))
        if copy_seconds and method == 'baseline-local':
            copies = [copy_seconds] * len(xs)
            ax.bar(xs, copies, width, bottom=heights, color='white',
                   edgecolor=COLOURS[method], hatch='//',
                   label='copy to local ({:.1f} s, {}-way)'.format(
                       copy_seconds, copy_ways))
        for x, h in zip(xs, heights):
            top = h + (copy_seconds if copy_seconds and
                       method == 'baseline-local' else 0)
            ax.text(x, top, '{:.0f}'.format(top), ha='center', va='bottom',
                    fontsize=7)
    ax.set_xticks(range(len(procs)))
    ax.set_xticklabels(['K={}'.format(k) for k in procs])
    ax.set_xlabel('MPI processes (one machine)')
    ax.set_ylabel('time of the run [s]')
    ax.legend(fontsize=8)


def figure7(data, runs, out):
    fig, ax = plt.subplots(figsize=(7, 4.2))
    _grouped_bars(ax, runs)
    ax.set_title('Fig. 7: {} epochs, total time per process count'.format(
        data['config']['epochs']))
    return save_figure(fig, out, 'fig7_total_time.png')


def figure8(data, runs, out):
    copy = data.get('copy') or {}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    _grouped_bars(ax, runs, copy_seconds=copy.get('seconds'),
                  copy_ways=copy.get('ways', 8))
    ax.set_title('Fig. 8: total time, copy time added to baseline-local')
    return save_figure(fig, out, 'fig8_total_with_copy.png')


def figures9_11(data, runs, out):
    k = _largest_complete_k(runs)
    keys = by_key(runs)
    chosen = [(m, keys[(m, k)]) for m in METHODS if (m, k) in keys]
    if not chosen:
        return []
    top = max(e['wall'] for _, run in chosen for e in epoch_means(run))
    paths = []
    for number, method in zip((9, 10, 11), METHODS):
        run = keys.get((method, k))
        if run is None:
            continue
        epochs = epoch_means(run)
        fig, ax = plt.subplots(figsize=(7.5, 4))
        xs = [e['epoch'] for e in epochs]
        bottom = [0.0] * len(epochs)
        for component in STACK:
            values = [max(e[component], 0.0) for e in epochs]
            ax.bar(xs, values, 0.7, bottom=bottom, label=component,
                   color=COMPONENT_COLOURS[component])
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_ylim(0, top * 1.08)
        ax.set_xticks(xs)
        ax.set_xlabel('epoch')
        ax.set_ylabel('seconds (mean over {} ranks)'.format(k))
        share = other_share(run)
        ax.set_title('Fig. {}: {}{}, K={}; other {:.0f}%'.format(
            number, method, '' if method == PAPER_NAMES[method] else
            ' ({})'.format(PAPER_NAMES[method]), k, 100 * share))
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(handles[::-1], labels[::-1], fontsize=8,
                  loc='center left', bbox_to_anchor=(1.0, 0.5))
        fig.tight_layout()
        path = os.path.join(out, 'fig{}_breakdown_{}.png'.format(number,
                                                                 method))
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


# ---------------------------------------------------------------- tables


def table4(data, runs):
    keys = by_key(runs)
    lines = ['Table 4: load time of the first iterations (seconds; mean '
             'over ranks, max in brackets)', '']
    header = '{:<16} {:>3} {:>16} {:>10} {:>12} {:>10} {:>14}'.format(
        'method', 'K', 'first iter', 'second', 'epoch-1 load', '1st share',
        'paper 1st/SSD')
    lines += [header, '-' * len(header)]
    for k in _procs_list(runs):
        base = keys.get(('baseline-local', k))
        for method in METHODS:
            run = keys.get((method, k))
            if run is None:
                continue
            first, first_max, second = first_loads(run)
            epoch1 = epoch_means(run)[0]['load']
            paper = _ratio(PAPER_TABLE4_FIRST_LOAD[method],
                           PAPER_TABLE4_FIRST_LOAD['baseline-local'])
            ours = _ratio(first, first_loads(base)[0]) if base else None
            lines.append(
                '{:<16} {:>3} {:>7} ({:>6}) {:>10} {:>12} {:>9}% '
                '{:>6} ({:>5})'.format(
                    method, k, _fmt(first, '.3f'), _fmt(first_max, '.3f'),
                    _fmt(second, '.4f'), _fmt(epoch1, '.3f'),
                    _fmt(100 * first / epoch1 if epoch1 else None, '.0f'),
                    _fmt(paper), _fmt(ours)))
    lines += ['', 'paper (16 nodes): first iteration load SSD 334.55 s, '
              'Lustre 289.92 s, proposed 683.31 s; >90% of the load time '
              'in the first iteration.  "paper 1st/SSD" = paper ratio to '
              'baseline+SSD (ours in brackets).']
    return '\n'.join(lines)


def tables_a(data, runs):
    keys = by_key(runs)
    copy = data.get('copy') or {}
    lines = ['Tables A.1-A.3: {} epochs; iterations per rank; iter/s = '
             'iterations / total time; MiB/s = bytes of the images read per '
             'iteration (all ranks: mean train file {:.1f} KB x {} x K) x '
             'iter/s'.format(data['config']['epochs'],
                             data['dataset'].get('train_mean_bytes', 0) / 1e3,
                             data['config']['batchsize']), '']
    header = ('{:<16} {:>3} {:>9} {:>9} {:>6} {:>8} {:>8} {:>9} {:>11}'
              .format('method', 'K', 'total s', 'train s', 'iters',
                      'iter/s', 'MiB/s', 'vs local', 'paper(1node)'))
    for number, method in zip(('A.1', 'A.2', 'A.3'), METHODS):
        lines += ['Table {}: {} ({})'.format(number, method,
                                             PAPER_NAMES[method]),
                  header, '-' * len(header)]
        for k in _procs_list(runs):
            run = keys.get((method, k))
            if run is None:
                continue
            base = keys.get(('baseline-local', k))
            total = run['wall_seconds']
            n = iterations(run)
            rate = n / total
            bpi = bytes_per_iteration(data, run)
            mibps = bpi * rate / 2 ** 20 if bpi else None
            paper = (_ratio(PAPER_TOTAL_1NODE[method],
                            PAPER_TOTAL_1NODE['baseline-local'])
                     if k == PAPER_PROCS else None)
            lines.append(
                '{:<16} {:>3} {:>9.1f} {:>9.1f} {:>6} {:>8.2f} {:>8} {:>9} '
                '{:>11}'.format(
                    method, k, total, train_seconds(run), n, rate,
                    _fmt(mibps), _fmt(_ratio(total, base['wall_seconds'])
                                      if base else None),
                    _fmt(paper)))
        lines.append('')
    if copy:
        lines.append('Table 3: {}-way parallel copy of {} files ({:.1f} MB) '
                     'from the mount: {:.2f} s ({:.0f} files/s); paper: '
                     '1,261,197 files in 1,575-2,032 s per node.'.format(
                         copy['ways'], copy['files'], copy['bytes'] / 1e6,
                         copy['seconds'], copy['files_per_second']))
    lines.append('paper, 1 node (4 processes), {:,} iterations: SSD '
                 '14,339.98 s, Lustre 45,586.36 s (3.18x), proposed '
                 '15,878.37 s (1.11x).'.format(PAPER_ITERATIONS_1NODE))
    return '\n'.join(lines)


def _status(value, limit):
    if value is None:
        return 'n/a'
    return 'met' if value <= limit else 'NOT met'


def targets(data, runs):
    keys = by_key(runs)
    main_k = _largest_complete_k(runs)
    lines = ['Targets (K = process count; the largest complete K = {} is '
             'the main one):'.format(main_k)]
    for k in _procs_list(runs):
        local = keys.get(('baseline-local', k))
        remote = keys.get(('baseline-remote', k))
        proposed = keys.get(('proposed', k))
        if proposed is None:
            continue
        if local:
            value = _ratio(epoch_means(proposed)[0]['wall'],
                           epoch_means(local)[0]['wall'])
            lines.append('  K={}: epoch-1 time proposed / baseline-local '
                         '<= {}: {} {}'.format(k, TARGET_EPOCH1,
                                               _fmt(value),
                                               _status(value, TARGET_EPOCH1)))
        if remote:
            value = _ratio(first_loads(proposed)[0], first_loads(remote)[0])
            lines.append('  K={}: first-iteration load proposed / '
                         'baseline-remote <= {}: {} {}'.format(
                             k, TARGET_FIRST_LOAD, _fmt(value),
                             _status(value, TARGET_FIRST_LOAD)))
        mine = other_share(proposed)
        for name, base in (('baseline-local', local),
                           ('baseline-remote', remote)):
            if base is None:
                continue
            theirs = other_share(base)
            lines.append('  K={}: "other" share proposed {:.0f}% vs {} '
                         '{:.0f}% (not higher; paper 63-71% vs ~43%): '
                         '{}'.format(k, 100 * mine, name, 100 * theirs,
                                     'met' if mine <= theirs else 'NOT met'))
    copy = data.get('copy') or {}
    local = keys.get(('baseline-local', main_k))
    proposed = keys.get(('proposed', main_k))
    if copy and local and proposed:
        with_copy = local['wall_seconds'] + copy['seconds']
        lines.append('  K={}: proposed / (baseline-local + copy) (Fig. 8; '
                     'paper: < 1 at every node count): {} {}'.format(
                         main_k, _fmt(proposed['wall_seconds'] / with_copy),
                         _status(proposed['wall_seconds'] / with_copy, 1.0)))
    order = sorted((m for m in METHODS if (m, main_k) in keys),
                   key=lambda m: keys[(m, main_k)]['wall_seconds'])
    lines.append('  K={}: order of total time: {} (paper at 1-4 nodes: '
                 'baseline-local < proposed < baseline-remote)'.format(
                     main_k, ' < '.join(order)))
    return '\n'.join(lines)


def failures(data):
    bad = [run for run in data['runs'] if run not in good_runs(data)]
    return ['FAILED: {} K={} rc={}{}'.format(
        run['method'], run['procs'], run['returncode'],
        ' (timed out)' if run.get('timed_out') else '') for run in bad]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('raw', help='raw.json of run_training_experiments.py')
    parser.add_argument('--out', default=None,
                        help='output folder (default: next to raw)')
    args = parser.parse_args(argv)
    out = args.out or os.path.dirname(os.path.abspath(args.raw))
    os.makedirs(out, exist_ok=True)
    data = load(args.raw)
    runs = good_runs(data)
    for line in failures(data):
        print(line)
    if not runs:
        print('no finished runs in', args.raw)
        return 1
    paths = [figure7(data, runs, out), figure8(data, runs, out)]
    paths += figures9_11(data, runs, out)
    texts = {'table4.txt': table4(data, runs),
             'tableA.txt': tables_a(data, runs),
             'targets.txt': targets(data, runs)}
    for name, text in texts.items():
        with open(os.path.join(out, name), 'w') as f:
            f.write(text + '\n')
        print(text)
        print()
        paths.append(os.path.join(out, name))
    print('wrote:', ', '.join(os.path.relpath(p) for p in paths))
    return 0


if __name__ == '__main__':
    sys.exit(main())
