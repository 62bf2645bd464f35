"""Weight-sync groups: a refit broadcast from the trainer's sending rank to every engine rank.

A group is a process group of rollgen's own (not the trainer's default group, not the
engine's), built from a TCP store at the address and port the trainer gives: gloo on CPU,
NCCL on CUDA. The trainer's sending rank is rank 0 and hosts the store (``WeightSender``);
engine ranks are 1..N (every tensor-parallel rank of every data-parallel replica).

Who is a member: a rank that holds the spec's secret. Before anything else crosses the group,
every rank proves it does (a tag over fresh nonces of every rank); manifests and errors travel
as JSON data, each with a tag over its place in the group's sequence, so a non-member can
neither read the weights' layout nor forge a message, and nothing is unpickled. The weights
themselves cross gloo or NCCL in plaintext, unauthenticated: the group's address belongs on a
network only the trainer and the engines reach.

One update runs in three steps, on every rank at once:
1. the sender broadcasts a manifest: each bucket's tensor names, shapes and dtypes, whether
   the update is partial, and the sender's own rejection (NaN or infinite values);
2. every engine rank checks the manifest against the served model; if one rejects it, all
   ranks (the sender too) raise its ``RefitError`` and nothing was applied;
3. the sender broadcasts each bucket as one flat buffer (packing the next while the last is
   on the wire); each engine rank receives the next while it loads the last. A rank that fails
   to load keeps receiving (the broadcast needs every rank) and its error, marked ``stale``,
   reaches every rank at the end.
A collective that fails (a rank gone, a timeout) breaks the group: a ``RefitError``, ``stale``
only when it came during step 3.

Modules, each importing only those before it: ``spec`` (``SyncGroupSpec``), ``wire`` (manifests
and errors as data), ``group`` (``SyncGroup``: joining, authenticating, the store, the
collectives), ``sender`` (``WeightSender``), ``receiver`` (``receive``) and ``transport``
(``CollectiveReceiver``, an engine rank's end as a refit transport).
"""

from rollgen.refit.transports.collective.group import SyncGroup, open_store
from rollgen.refit.transports.collective.receiver import receive
from rollgen.refit.transports.collective.sender import WeightSender
from rollgen.refit.transports.collective.spec import SyncBackend, SyncGroupSpec
from rollgen.refit.transports.collective.transport import CollectiveReceiver

__all__ = [
    "CollectiveReceiver",
    "SyncBackend",
    "SyncGroup",
    "SyncGroupSpec",
    "WeightSender",
    "open_store",
    "receive",
]
