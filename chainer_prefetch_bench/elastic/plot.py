#!/usr/bin/env python
"""Figures and table of ``chainer_prefetch_bench.elastic.run``.

Usage::

    python -m chainer_prefetch_bench.elastic.plot results/elastic

Writes ``fig_fixed.png`` (epoch vs wall time at 1, 2, 4 members: the
source's Fig. 5), ``fig_grow.png`` (2 -> 4 members: Fig. 6),
``fig_shrink.png`` (4 -> 2 by SIGKILL: Fig. 7) and ``table.md`` (medians
over the repeats, with their range).
"""
import argparse
import json
import os
import statistics

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # NOQA: E402

from chainer_prefetch_bench.testbed.report import save_figure  # NOQA: E402

STYLE = {'fixed1': ('C0', '-'), 'fixed2': ('C1', '-'), 'fixed4': ('C2', '-'),
         'grow': ('C3', '-'), 'grow-plain': ('C3', ':'),
         'shrink': ('C4', '-'), 'shrink-plain': ('C4', ':')}
LABEL = {'fixed1': '1 member', 'fixed2': '2 members', 'fixed4': '4 members',
         'grow': '2 -> 4 (locality split)', 'grow-plain': '2 -> 4 (plain split)',
         'shrink': '4 -> 2 by SIGKILL (locality split)',
         'shrink-plain': '4 -> 2 by SIGKILL (plain split)'}


def runs_named(results, name):
    return [run for run in results['runs'] if run['name'] == name]


def curve_figure(results, names, title, out, filename):
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in names:
        for run in runs_named(results, name):
            colour, style = STYLE[name]
            t = [0] + [point[0] for point in run['curve']]
            epochs = [0] + [point[1] for point in run['curve']]
            ax.step(t, epochs, where='post', color=colour, linestyle=style,
                    alpha=0.9 if run['repeat'] == 0 else 0.4,
                    label=LABEL[name] if run['repeat'] == 0 else None)
            if 'event' in run:
                ax.axvline(run['event'], color=colour, linestyle='--',
                           alpha=0.3)
    ax.set_xlabel('wall time (s)')
    ax.set_ylabel('epoch')
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, out, filename)


def median_range(values, digits=2):
    values = [v for v in values if v is not None]
    if not values:
        return '-'
    text = '{:.{d}f}'.format(statistics.median(values), d=digits)
    if len(values) > 1:
        text += ' [{:.{d}f}-{:.{d}f}]'.format(min(values), max(values),
                                              d=digits)
    return text


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def read_events(results_dir, run):
    path = os.path.join(results_dir, 'events', '{}.{}.jsonl'.format(
        run['name'], run['repeat']))
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def phases(results_dir, run):
    """Where the time from the event to training again went (seconds):
    ``seen`` (the event until the first member starts a rebuild; for a
    join, until the last joiner has registered), ``decide`` (until the
    leader's decision: lease expiry and settle window), ``form`` (until
    every member is in the new gloo group), ``state`` (until every member
    has the state and its new shard)."""
    events = read_events(results_dir, run)
    t0 = min(e['time'] for e in events if e['event'] == 'start')
    event = t0 + run['event']
    generation = run['generation']
    at = {name: [e['time'] for e in events if e['event'] == name
                 and e.get('generation') == generation]
          for name in ('decided', 'formed', 'resumed')}
    if run['name'].startswith('grow'):
        seen = max(e['time'] for e in events if e['event'] == 'registered'
                   and e['time'] >= event)
    else:
        seen = min(e['time'] for e in events if e['event'] == 'rebuild'
                   and e['time'] >= event)
    decided = min(at['decided'])
    formed = max(at['formed'])
    return dict(seen=seen - event, decide=decided - seen,
                form=formed - decided, state=max(at['resumed']) - formed)


def table(results, results_dir):
    fixed = {size: median([r['slope'] for r in runs_named(
        results, 'fixed{}'.format(size))]) for size in (1, 2, 4)}
    lines = ['# Elastic training on one 2-core machine',
             '',
             'Command: `{}`'.format(results['command']),
             '',
             'Medians over {} repeats [min-max]; slope = epochs per second '
             '(least squares over the epoch ends).'.format(
                 results['settings']['repeats']),
             '',
             '## Fixed sizes',
             '',
             '| run | slope (epoch/s) | wall s | final val. accuracy |',
             '|---|---|---|---|']
    for name in ('fixed1', 'fixed2', 'fixed4'):
        runs = runs_named(results, name)
        lines.append('| {} | {} | {} | {} |'.format(
            LABEL[name], median_range([r['slope'] for r in runs], 3),
            median_range([r['wall'] for r in runs], 1),
            median_range([r['final_accuracy'] for r in runs], 3)))
    lines += ['', '## Changes of size', '',
              '| run | slope before | fixed at old size | slope after | '
              'fixed at new size | event -> all training s | rendezvous s | '
              'state s | final val. accuracy | wall s |',
              '|---|---|---|---|---|---|---|---|---|---|']
    for name, old, new in (('grow', 2, 4), ('grow-plain', 2, 4),
                           ('shrink', 4, 2), ('shrink-plain', 4, 2)):
        runs = runs_named(results, name)
        if not runs:
            continue
        lines.append('| {} | {} | {:.3f} | {} | {:.3f} | {} | {} | {} | {} | '
                     '{} |'.format(
                         LABEL[name],
                         median_range([r['slope_before'] for r in runs], 3),
                         fixed[old],
                         median_range([r['slope_after'] for r in runs], 3),
                         fixed[new],
                         median_range([r['recovery'] for r in runs]),
                         median_range([r['rendezvous'] for r in runs]),
                         median_range([r['state'] for r in runs], 3),
                         median_range([r['final_accuracy'] for r in runs], 3),
                         median_range([r['wall'] for r in runs], 1)))
    lines += ['', '## Where the time from the event to training again goes', '',
              'Medians, seconds: seen = event until the first member starts '
              'a rebuild (a kill: its peers\' collective fails) or until the '
              'last joiner has registered (a join: process start, imports, '
              'etcd); decide = until the leader decides (a kill: the live '
              'members come to the rebuild and loss_grace passes; a join: '
              'the settle window); form = until '
              'every member is in the new gloo group; state = until every '
              'member has the model, optimizer state and its new shard.',
              '', '| run | seen | decide | form | state | total |',
              '|---|---|---|---|---|---|']
    for name in ('grow', 'grow-plain', 'shrink', 'shrink-plain'):
        runs = runs_named(results, name)
        if not runs:
            continue
        parts = [phases(results_dir, run) for run in runs]
        lines.append('| {} | {} | {} | {} | {} | {} |'.format(
            LABEL[name], *[median_range([p[key] for p in parts])
                           for key in ('seen', 'decide', 'form', 'state')],
            median_range([r['recovery'] for r in runs])))
    lines += ['', '## Shared-storage reads after the re-split', '',
              'Examples each member was given at the change (shard), how many '
              'of them its node already held (kept local; what the plain '
              'contiguous split would have kept in brackets), and what the '
              'members read from shared storage from then to the end '
              '(files copied + examples read directly), summed over the '
              'members.', '',
              '| run | members x shard | kept local (plain split) | '
              'shared reads after |',
              '|---|---|---|---|']
    for name in ('grow', 'grow-plain', 'shrink', 'shrink-plain'):
        runs = runs_named(results, name)
        if not runs:
            continue
        kept = 'not tracked'
        if not name.endswith('-plain'):
            kept = '{} ({})'.format(
                median_range([r['kept_local'] for r in runs], 0),
                median_range([r['plain_kept_local'] for r in runs], 0))
        lines.append('| {} | {} x {} | {} | {} |'.format(
            LABEL[name], runs[0]['final_size'], runs[0]['shard'], kept,
            median_range([r['reads_after'] for r in runs], 0)))
    ok = all(r['identical_parameters'] and not r['keys_left']
             for r in results['runs'])
    lines += ['', 'Every member of every run ended with bit-identical '
              'parameters and no etcd key was left: {}.'.format(
                  'yes' if ok else 'NO')]
    return '\n'.join(lines) + '\n'


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('results')
    args = parser.parse_args(argv)
    with open(os.path.join(args.results, 'elastic.json')) as f:
        results = json.load(f)
    curve_figure(results, ('fixed1', 'fixed2', 'fixed4'),
                 'Fixed sizes (cf. source Fig. 5)', args.results,
                 'fig_fixed.png')
    curve_figure(results, ('fixed2', 'fixed4', 'grow', 'grow-plain'),
                 '2 -> 4 members mid-run (cf. Fig. 6)', args.results,
                 'fig_grow.png')
    curve_figure(results, ('fixed4', 'fixed2', 'shrink', 'shrink-plain'),
                 '4 -> 2 members by SIGKILL mid-run (cf. Fig. 7)',
                 args.results, 'fig_shrink.png')
    text = table(results, args.results)
    with open(os.path.join(args.results, 'table.md'), 'w') as f:
        f.write(text)
    print(text)


if __name__ == '__main__':
    main()
