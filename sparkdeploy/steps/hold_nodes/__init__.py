"""Node locks: one deployment per machine, held from boot to teardown, across flow runs.

A lock is the machine's, not the inventory's name for it: two inventories may name one machine
differently, and must share its lock. The machine is known by its /etc/machine-id
(sparkdeploy.remote.node_identity, read over SSH as the deploy starts). Each machine has a Prefect
global concurrency limit `node:<machine-id prefix>` with limit 1, created on demand. A
deployment takes one slot of every node's limit in a single request (all or none, so two
deploys on overlapping nodes cannot each hold half and wait forever) and gives them back at
teardown. Who holds a machine is recorded in a Prefect Variable per machine
(`node-lock-<machine-id prefix>`, visible in the UI): the deployment, its flow run, and the
cluster and node name it took the machine by, so a waiting deploy can name the holder. The
slots come first, then the records; a failure or cancel in between gives back the slots just
taken and deletes the records written, since an unrecorded holder would be waited on by every
later deploy.

A holder that is provably gone is taken over instead of waited for: its flow run has ended
(Prefect says its state is final, or the run no longer exists) and, for another deployment, no
container of it is left on the node (asked over SSH by the caller's `containers_on`). A run of
the same deployment that has ended is a redeploy: its containers are a stale copy of this
deployment, which boot replaces. The redeploy's record keeps the run it took over from
(`took_over_from`): a redeploy that fails, is cancelled or crashes before its boot replaced that
copy hands the node back to that run (hand_back_to_serving), so the hold names the run whose
containers serve. Taking over keeps the slot (it passes from the old holder to
the new) and rewrites the record, under a short per-machine mutex (`node-takeover:<machine-id
prefix>`) so two deploys never both take over one stale holder.

Leases. Prefect 3 can lease slots (they go back when the lease is not renewed in time). The node
slots are taken without one: no process lives as long as a deployment (the deploy flow run ends
while its engine serves), so a lease would need a renewer whose death, or a worker restart,
frees a node under a running engine; and Prefect keeps leases in the server's memory by default
(`PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE`), so a server restart would forget them and leak the
slots. Whether a holder is gone is proven instead, from the flow run's state and the node's
containers. The takeover mutex is leased (Prefect's minimum, 60 s): it is held for two requests,
and a deploy killed while holding it must not block takeovers of that node for good.

Arrival order. A deploy that must wait records a ticket (a Prefect Variable
`node-wait-<random>`, tagged node-wait, naming its deployment, flow run and machines); the server
stamps its creation time. A deploy takes free machines only when no live ticket created before
its own (or, before it has one, any live ticket) wants one of them, so deploys waiting for a
machine get it in the order they began to wait, and a newcomer does not overtake them. A ticket
is live while its flow run goes on and its waiter refreshes it every poll: one whose run has
ended, or which was not refreshed for TICKET_STALE_S by the server's clock, is passed over. The
waiter removes its ticket when it takes the machines or gives up.

Replacing. A deploy with `replace` names the deployments it replaces (`replacing`: holder's
deployment id -> the deployment to bring back if the new one fails); their nodes are taken over
once their own flow runs have ended, containers and all, and the new record says which
deployment it replaced (`replaces`) until the replacement is committed (commit_replacement) or
given back (give_back). A record that still says `replaces` after its flow run has ended is a
replacement that never finished (its process was killed: no rollback hook ran). It is judged by
both deployments' containers: a deploy without `replace` waits while either is on the node, and
a deploy with `replace` takes it over and inherits the deployment to bring back, so a failure
of the next attempt still rolls back to what served before the killed one.

One module per job (this one is the step's API):
  acquire.py    acquire_nodes: the nodes held, taken over or waited for; records or nothing
  release.py    give_back, hand_back_to_serving, commit_replacement, release_nodes
  records.py    the lock's names on the server; the holder records (NodeHolder, Replaced)
  decisions.py  ours, take over or wait, for each held node, and why it is waited for
  takeover.py   holders provably gone taken over, under the takeover mutex
  queue.py      the wait tickets that keep arrival order
  slots.py      the global concurrency limits' slots, taken all or none and given back
  runs.py       which flow run this is, which have ended
  api.py        Prefect's busy answers retried on our own, short schedule
"""

from sparkdeploy.steps.hold_nodes.acquire import DEFAULT_TIMEOUT_S, acquire_nodes
from sparkdeploy.steps.hold_nodes.decisions import (
    ContainerCheck,
    holder_decision,
    unfinished_replacement,
)
from sparkdeploy.steps.hold_nodes.records import (
    NodeHolder,
    Replaced,
    holder_variable,
    holders,
    limit_name,
)
from sparkdeploy.steps.hold_nodes.release import (
    commit_replacement,
    give_back,
    hand_back_to_serving,
    release_nodes,
)
from sparkdeploy.steps.hold_nodes.runs import ended_runs

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ContainerCheck",
    "NodeHolder",
    "Replaced",
    "acquire_nodes",
    "commit_replacement",
    "ended_runs",
    "give_back",
    "hand_back_to_serving",
    "holder_decision",
    "holder_variable",
    "holders",
    "limit_name",
    "release_nodes",
    "unfinished_replacement",
]
