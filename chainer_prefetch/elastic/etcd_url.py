"""The address of an elastic job: ``etcd://host:port[,host:port...]/job``.

Pure: parsing it needs no etcd client, so a wrong ``--elastic`` value is
reported before anything is started.
"""
import re
from typing import NamedTuple, Tuple

URL_PATTERN = re.compile(r'^etcd://(?P<endpoints>[^/]+)/(?P<job>[A-Za-z0-9._-]+)/?$')
URL_EXAMPLE = 'etcd://127.0.0.1:2379/my-job (or etcd://e1:2379,e2:2379/my-job)'


class EtcdUrl(NamedTuple):
    """A parsed ``etcd://host:port[,host:port...]/job`` address.

    Attributes:
        endpoints: ``(host, port)`` of each etcd server.
        job: The job key; every process of a job uses the same one.
    """
    endpoints: Tuple[Tuple[str, int], ...]
    job: str

    def __str__(self) -> str:
        return 'etcd://{}/{}'.format(','.join(
            '{}:{}'.format(host, port) for host, port in self.endpoints),
            self.job)

    @property
    def prefix(self) -> str:
        """The etcd key prefix of the job."""
        return '/chainer_prefetch/elastic/{}/'.format(self.job)


def parse_etcd_url(url: str) -> EtcdUrl:
    """Parses ``etcd://host:port[,host:port...]/job``.

    Raises:
        ValueError: not such an address (the message shows one).
    """
    match = URL_PATTERN.match(url.strip())
    if not match:
        raise ValueError('not an etcd job address: {!r}; expected {}'.format(
            url, URL_EXAMPLE))
    endpoints = []
    for part in match.group('endpoints').split(','):
        host, _, port = part.rpartition(':')
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError('bad etcd endpoint {!r} in {!r}; expected {}'
                             .format(part, url, URL_EXAMPLE))
        endpoints.append((host.strip('[]'), int(port)))
    return EtcdUrl(tuple(endpoints), match.group('job'))
