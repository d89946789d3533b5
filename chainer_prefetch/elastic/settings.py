"""The settings of elastic training, validated once."""
from typing import NamedTuple, Optional


class ElasticSettings(NamedTuple):
    """Time limits and addresses of elastic training (seconds).

    Attributes:
        ttl: Lease of each member's key: a member that stops refreshing it
            (killed, stopped, cut off) is gone this long after (integer;
            etcd rounds anything below 2 up to 2).
        settle: Settle window: a change of membership is acted on once the
            membership has not changed for this long (a burst of joins
            becomes one rebuild).
        loss_grace: After a collective failed, the members of the group
            that have not come to the rebuild within this long are left
            out of the next group (a killed one never comes; a live member
            slower than this joins again at the following rebuild), without
            waiting for their leases.
        collective_timeout: A collective that makes no progress this long
            is abandoned and the group rebuilt (bounds a hung member whose
            key is still alive).
        rendezvous_timeout: Forming a group may take this long.
        wait_timeout: The policy may keep the job waiting this long before
            it fails (``ScaleFailed``).
        etcd_timeout: etcd may be unreachable this long, at start or during
            the run, before the job ends (``EtcdUnavailable``).
        advertise_host: Address other members reach this one at (default:
            the address this machine uses to reach etcd).
    """
    ttl: int = 3
    settle: float = 1.0
    loss_grace: float = 0.5
    collective_timeout: float = 60.0
    rendezvous_timeout: float = 60.0
    wait_timeout: float = 600.0
    etcd_timeout: float = 10.0
    advertise_host: Optional[str] = None

    def validated(self) -> 'ElasticSettings':
        """These settings, checked.

        Raises:
            ValueError: a limit that is not positive, or a collective or
                rendezvous timeout not above the lease (a lost member must
                be seen before a collective gives up).
        """
        for name in ('ttl', 'collective_timeout', 'rendezvous_timeout',
                     'wait_timeout', 'etcd_timeout'):
            if not getattr(self, name) > 0:
                raise ValueError('ElasticSettings.{} must be > 0, got {!r}'
                                 .format(name, getattr(self, name)))
        for name in ('settle', 'loss_grace'):
            if getattr(self, name) < 0:
                raise ValueError('ElasticSettings.{} must be >= 0, got {!r}'
                                 .format(name, getattr(self, name)))
        if int(self.ttl) != self.ttl:
            raise ValueError('ElasticSettings.ttl must be whole seconds, '
                             'got {!r}'.format(self.ttl))
        return self
