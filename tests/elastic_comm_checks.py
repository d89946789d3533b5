"""The checks of a ChainerMN CPU communicator, run on ElasticCommunicator
(one process per member; tests/test_elastic_core.py starts three)."""
import sys
import time

import chainer
import chainer.links as L
import chainermn
import numpy
from chainer.training import extensions

from chainer_prefetch import elastic


def main(url):
    comm = elastic.ElasticCommunicator(url, elastic.FailStop(3),
                                       elastic.ElasticSettings(ttl=2))
    rank, size = comm.rank, comm.size
    assert size == 3 and comm.intra_size == 3 and comm.inter_size == 1
    assert isinstance(comm, chainermn.CommunicatorBase)

    # Objects.
    assert comm.bcast_obj({'a': rank} if rank == 1 else None, root=1) == {'a': 1}
    gathered = comm.gather_obj(rank * 10, root=2)
    assert gathered == ([0, 10, 20] if rank == 2 else None)
    assert comm.allreduce_obj(rank + 1) == 6
    assert numpy.allclose(comm.allreduce_obj(numpy.full(3, rank, 'f')), 3)
    if rank == 0:
        comm.send_obj(('hello', [1, 2]), dest=2, tag=7)
    elif rank == 2:
        assert comm.recv_obj(0, tag=7) == ('hello', [1, 2])

    # Arrays.
    x = numpy.arange(6, dtype=numpy.float32).reshape(2, 3) + rank
    assert numpy.array_equal(comm.allreduce(x), 3 * numpy.arange(6).reshape(2, 3) + 3)
    got = comm.bcast(x if rank == 0 else None, root=0)
    assert numpy.array_equal(got, numpy.arange(6).reshape(2, 3))
    gathered = comm.allgather(x)
    assert [int(g[0, 0]) for g in gathered] == [0, 1, 2]
    parts = comm.alltoall(tuple(numpy.full(2, 10 * rank + dest, 'i') for dest in range(3)))
    assert [int(p[0]) for p in parts] == [10 * src + rank for src in range(3)]
    part = comm.scatter([numpy.full(2, i, 'd') for i in range(3)] if rank == 0 else None)
    assert numpy.array_equal(part, numpy.full(2, rank, 'd'))
    if rank == 1:
        comm.send((x, x * 2), dest=0, tag=3)
    elif rank == 0:
        a, b = comm.recv(1, tag=3)
        assert numpy.array_equal(b, 2 * (numpy.arange(6).reshape(2, 3) + 1))

    # scatter_dataset: every example once over the members (equal length).
    shard = chainermn.scatter_dataset(list(range(10)) if rank == 0 else None,
                                      comm, shuffle=True, seed=0)
    everything = comm.allgather_obj(list(shard))
    assert sorted(set(sum(everything, []))) == list(range(10))
    assert len({len(s) for s in everything}) == 1

    # The multi-node optimizer: bcast_data at the first update, then the
    # mean of the gradients.
    model = L.Linear(3, 2)
    optimizer = chainermn.create_multi_node_optimizer(
        chainer.optimizers.SGD(lr=1.0), comm)
    optimizer.setup(model)
    model.cleargrads()
    optimizer.update()  # broadcast from rank 0
    w0 = comm.bcast_obj(model.W.array.copy())
    assert numpy.array_equal(model.W.array, w0)
    model.W.grad = numpy.full_like(model.W.array, rank)
    model.b.grad = numpy.full_like(model.b.array, 2 * rank)
    optimizer.update()
    assert numpy.allclose(model.W.array, w0 - 1.0)  # mean of 0, 1, 2
    assert numpy.allclose(comm.allreduce_obj(model.W.array) / 3, model.W.array)

    # The multi-node evaluator: the mean over the members.
    class Mean(chainer.Chain):
        def forward(self, x):
            chainer.reporter.report({'value': float(numpy.mean(x))}, self)
            return x
    data = numpy.full((4, 1), rank, dtype=numpy.float32)
    target = Mean()
    evaluator = chainermn.create_multi_node_evaluator(extensions.Evaluator(
        chainer.iterators.SerialIterator(data, 2, repeat=False, shuffle=False),
        target), comm)
    reporter = chainer.Reporter()
    reporter.add_observer('main', target)
    with reporter.scope({}):
        result = evaluator.evaluate()
    assert numpy.isclose(result['main/value'], 1.0), result
    comm.finish()


def leave_check(url):
    """A member that leaves its group at an iteration boundary (rank 1,
    not the leader: no newer decision appears meanwhile) must release a
    peer blocked in a collective at once, not after collective_timeout."""
    comm = elastic.ElasticCommunicator(url, elastic.FailStop(2),
                                       elastic.ElasticSettings(
                                           ttl=2, settle=0.2,
                                           collective_timeout=30))
    first = comm.generation
    if comm.rank == 1:
        time.sleep(1)
        comm.rebuild()
    else:
        started = time.monotonic()
        try:
            comm.allreduce(numpy.ones(3))
            raise AssertionError('the allreduce returned without its peer')
        except elastic.MembershipChanged:
            pass
        waited = time.monotonic() - started
        assert waited < 10, 'released after {:.1f} s'.format(waited)
        comm.rebuild()
    assert (comm.generation, comm.size) == (first + 1, 2), (
        first, comm.generation, comm.size)
    assert comm.allreduce_obj(1) == 2
    comm.finish()


if __name__ == '__main__':
    {'checks': main, 'leave': leave_check}[sys.argv[2]](sys.argv[1])
