"""A private etcd on 127.0.0.1 for trying elastic training on one machine::

    python -m chainer_prefetch.elastic.local_etcd                # a free port
    python -m chainer_prefetch.elastic.local_etcd --port 23790   # a known one

It prints its ``etcd://127.0.0.1:PORT/JOB`` address and runs until Ctrl-C
or SIGTERM, then removes its data.  On a cluster, point ``--elastic`` at the
site's etcd instead.
"""
import argparse
import signal
import sys
import time

from chainer_prefetch.elastic.etcd import EtcdServer


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> None:
    """Runs a local etcd until Ctrl-C or SIGTERM; prints its address."""
    parser = argparse.ArgumentParser(
        description='Start a private etcd on 127.0.0.1 for elastic training')
    parser.add_argument('--job', default='job',
                        help='job key shown in the printed address')
    parser.add_argument('--port', type=int, default=None,
                        help='client port (default: a free one)')
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    server = EtcdServer(port=args.port)
    try:
        server.start()
        print(server.url(args.job), flush=True)
        while server.process.poll() is None:
            time.sleep(0.5)
    except (FileNotFoundError, RuntimeError) as error:
        sys.exit('chainer_prefetch.elastic.local_etcd: {}'.format(error))
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == '__main__':
    main()
