"""One node of the peer tests: stages the given files into its local
directory and serves them until its standard input closes.

``python tests/peer_node.py LOCAL_DIR TOKEN_HEX FILE...``; prints the port.
"""
import sys

from chainer_prefetch.staging.counters import Counters
from chainer_prefetch.staging.local_directory import LocalDirectory
from chainer_prefetch.staging.peer_transport import PeerServer
from chainer_prefetch.staging.peers import PEER_COUNTERS, make_lookup
from chainer_prefetch.staging.sources import PlainFile


def main():
    local_dir, token, paths = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3:]
    directory = LocalDirectory(local_dir)
    for path in paths:
        directory.stage(path)
    server = PeerServer('127.0.0.1', token, 5.0, Counters(PEER_COUNTERS))
    server.lookup = make_lookup(lambda item: [PlainFile(paths[item])],
                                directory.local_path)
    print(server.address[1], flush=True)
    sys.stdin.read()
    server.close()
    print(server.counters.snapshot(), flush=True)


if __name__ == '__main__':
    main()
