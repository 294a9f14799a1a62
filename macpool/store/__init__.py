"""The Redis contract between routers and node agents: key names (keys.py), the Lua scripts (``*.lua``) and
the one typed API that calls them (api.py)."""

from macpool.store.api import (
    ANONYMOUS,
    QUEUE_LEASE_MS,
    AffinityOutcome,
    Candidate,
    Lease,
    PoolSnapshot,
    Release,
    Reservation,
    ReserveRequest,
    ReserveStatus,
    Store,
)
from macpool.store.keys import DEFAULT_PREFIX, Keys

__all__ = [
    "ANONYMOUS", "DEFAULT_PREFIX", "QUEUE_LEASE_MS", "AffinityOutcome", "Candidate", "Keys", "Lease",
    "PoolSnapshot", "Release", "Reservation", "ReserveRequest", "ReserveStatus", "Store",
]
