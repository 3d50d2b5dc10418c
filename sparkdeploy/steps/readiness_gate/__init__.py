"""The readiness gate: follow every container's log at once, decide ready or why not.

    gate = gate_for(plan)
    result = wait_until_ready(plan, gate)      # GateResult, or errors.BootFailed

Ready = every required boot marker seen on the head, every worker marker (the rank-assignment
line) seen on each worker, then GET /health 200 and GET /v1/models listing the served name
(polled every 0.2 s once the markers are in; connection refused while the engine loads is
normal), then one real completion (POST /v1/completions, max_tokens 1, temperature 0, asked
once with the gate's time left) answering a choice. Recorded markers (sparkdeploy.vllm.markers:
DEFAULT_RECORDED_MARKERS, WORKER_RECORDED_MARKERS) go in the timeline and the figures when seen
but are never waited for. Any failure marker, any container exit (status 0 included: vLLM exits
0 after its engine died), the timeout, a wrong served name or a failed completion raises
errors.BootFailed at once, naming the node and the cause and quoting the log lines around it. A
worker that never joined is named at the timeout; a node whose SSH link dropped and did not come
back is named for the lost link, not blamed for the lines that could not arrive.
`gate.timeline` (markers, node, seconds since the start, parsed figures) is there after a
failure too.

One module per job:
  follow_logs.py  every container's `docker logs --follow` over SSH, fed to the gate's queue
  gate.py         ReadinessGate: the queue consumed, the endpoint probed; its GateResult
  watch.py        BootWatch: one boot's state as its events arrive (pure), the events
What a vLLM log line means is sparkdeploy.vllm.log_lines'; the HTTP probes are
sparkdeploy.remote.engine_http's.
"""

from sparkdeploy.steps.readiness_gate.follow_logs import follow_lines, gate_for, wait_until_ready
from sparkdeploy.steps.readiness_gate.gate import GateResult, ReadinessGate
from sparkdeploy.steps.readiness_gate.watch import GateEvent, TimelineEntry

__all__ = [
    "GateEvent",
    "GateResult",
    "ReadinessGate",
    "TimelineEntry",
    "follow_lines",
    "gate_for",
    "wait_until_ready",
]
