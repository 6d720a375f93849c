"""The bus client every service uses: NATS JetStream with llmgw's rules built in.

- Connection: URL from `LLMGW_NATS_URL`, credentials, nkeys or TLS; reconnects
  forever, and each disconnect and reconnect is logged. A connection that NATS
  closed for good (see `Bus.lost`) is said once, and every call on it raises
  ConnectionLost: a service ends then, for its supervisor to start it again
  (`lifecycle.while_connected`).
- No subject or key longer than MAX_SUBJECT_BYTES is sent (SubjectTooLong): the
  server would close the connection for it.
- Streams and buckets (`llmgw_core.topology`) are ensured idempotently at start.
- Every publish carries `Nats-Msg-Id` (deduplication) and W3C trace headers.
- A subscription or watch never dies of a bad message: it is logged with subject and
  msgspec's path, counted, copied to `<prefix>.dlq.<service>` and skipped.
- A KV watch yields every key's current value first, then changes, and
  survives a server restart without missing an update; over a store emptied or
  replaced, it yields each key that went with it as deleted.
- A store lost under a running cluster is noticed, said once (`Bus.losses`), and made
  whole by placement (`Bus.rebuild`) before it writes; a node identity waits for that.

`Bus` (facade.py) is the one object services hold, and the only door to NATS; the modules
beside it do the work (the map is in facade.py). Everything a caller needs is importable from here.
"""

from .batch import ATOMIC_MAX, Writes, _Write
from .connection import REFUSED_RECONNECT_GRACE_S, Connection, transient
from .deadletter import DecodeFailure
from .facade import Bus
from .kv import KV_OPS_DELETE, SNAPSHOT_INACTIVE_S, KVChange
from .lease import Lease, LeaseLost, read_lease
from .loss import Losses, StoreLoss
from .options import DEFAULT_URL, BusOptions
from .plain import NoAnswer
from .replay import Replayed
from .start import prepare_node, require_streams
from .watch import WATCH_TURN_EVERY

__all__ = [
    "ATOMIC_MAX",
    "DEFAULT_URL",
    "KV_OPS_DELETE",
    "REFUSED_RECONNECT_GRACE_S",
    "SNAPSHOT_INACTIVE_S",
    "WATCH_TURN_EVERY",
    "Bus",
    "BusOptions",
    "Connection",
    "DecodeFailure",
    "KVChange",
    "Lease",
    "LeaseLost",
    "Losses",
    "NoAnswer",
    "Replayed",
    "StoreLoss",
    "Writes",
    "_Write",
    "prepare_node",
    "read_lease",
    "require_streams",
    "transient",
]
