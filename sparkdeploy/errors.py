"""Every error the project raises on purpose, in one place.

Each carries a message written for the operator: what is wrong, where (file:line, key, node) and
what to do about it. The CLI prints the message alone; flows fail their run with it.
"""


class SparkDeployError(Exception):
    """Base of every error this project raises deliberately."""


class RecipeError(SparkDeployError):
    """A recipe file is malformed or inconsistent."""


class InventoryError(SparkDeployError):
    """A cluster inventory is malformed or inconsistent."""


class PlanError(SparkDeployError):
    """A recipe cannot be placed on the chosen nodes."""


class RecipeBlocked(PlanError):
    """The recipe says it must not be deployed (its `blocked` reason) and no override was given."""


class FitError(PlanError):
    """The fit check cannot size the deployment's memory (model not in the NAS, config lacking)."""


class DoesNotFit(FitError):
    """The model, its KV cache and the engine do not fit a node's memory (figures and knobs in
    the message)."""


class RemoteError(SparkDeployError):
    """A command on a node failed (not reachable, non-zero exit, timeout)."""


class TransientRemoteError(RemoteError):
    """A remote failure worth retrying: connection reset, timeout, 5xx."""


class EngramError(SparkDeployError):
    """An Engram config, a safetensors shard or a rank's byte ranges are inconsistent."""


class PrefetchError(SparkDeployError):
    """A repo cannot be put into the NAS HF cache: not found, gated, no space, corrupt."""


class TransientPrefetchError(PrefetchError):
    """A hub failure worth retrying: connection refused/reset, timeout, 5xx, 429.

    retry_after_s: the wait the hub's Retry-After asked for, when it said.
    """

    retry_after_s: float | None = None


class LabError(SparkDeployError):
    """The lab cluster cannot be brought up, inspected or torn down."""


class StagingError(SparkDeployError):
    """A recipe's node-local file (an Engram sparse copy, a plain file) cannot be put in place or
    verified on a node.

    The node scripts that put them there raise it too (sparkdeploy.node.engram_copy and
    plain_copy, shipped with this module): there `kind` names the case for the step
    (missing_source, no_space, linked_mismatch, ...) and `dest` the file it is about (None: all
    of them, e.g. free space), both sent back in the script's answer.
    """

    def __init__(self, message: str, *, kind: str | None = None, dest: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.dest = dest


class ComposeError(SparkDeployError):
    """A node's composed HF cache (NAS symlinks + local hardlinks) cannot be built."""


class EngineFailure(SparkDeployError):
    """An engine failure with a name: `kind`, the node it is on, the cause and the quoted log."""

    def __init__(self, message: str, *, node: str, kind: str, cause: str, excerpt: list[str]):
        super().__init__(message)
        self.node = node
        self.kind = kind
        self.cause = cause
        self.excerpt = excerpt

    def __reduce__(self) -> tuple[object, ...]:
        # Prefect pickles exceptions; the default reduce would call __init__(message) alone.
        return (
            _rebuild_engine_failure,
            (type(self), str(self), self.node, self.kind, self.cause, self.excerpt),
        )


def _rebuild_engine_failure(
    cls: type[EngineFailure], message: str, node: str, kind: str, cause: str, excerpt: list[str]
) -> EngineFailure:
    return cls(message, node=node, kind=kind, cause=cause, excerpt=excerpt)


class BootFailed(EngineFailure):
    """An engine did not become ready: a fatal log line, a container exit, or the timeout.

    `kind` is the failure marker's name or one of oom_killed, killed, container_exited, timeout,
    served_name_mismatch, worker_never_joined, completion_failed; `excerpt` holds the quoted
    log lines.
    """


class DeploymentDown(EngineFailure):
    """A deployment that was ready has stopped serving: a container gone or exited, or a fatal
    line in the head's log (the smoke watchdog's finding)."""


class SmokeFailed(SparkDeployError):
    """The endpoint answered, but badly: at least one smoke check failed (named in the message)."""


class QualityFailed(SparkDeployError):
    """The endpoint answers, but an eval of the recipe's [quality] scored past its threshold or
    gave no score (each named in the message, with its score or the eval's last lines)."""


class ImageError(SparkDeployError):
    """An engine image cannot be put on every node, or the nodes end up with different images."""


class ContainerStartError(SparkDeployError):
    """Containers cannot be started: a node failed preflight, or `docker run` was refused."""


class NodeLockError(SparkDeployError):
    """A node is held by another deployment (named in the message) past the lock timeout."""


class TeardownError(SparkDeployError):
    """A deployment's containers cannot be stopped or their logs cannot be saved."""


class BenchmarkError(SparkDeployError):
    """A benchmark cannot run: the endpoint does not answer, or its replies carry no usage."""


class CompareError(SparkDeployError):
    """A compare's sides are malformed: an override a recipe cannot take, nodes that clash."""


class RolledBack(SparkDeployError):
    """A replacing deploy failed and what it replaced serves again (named in the message)."""


class RepairLimitReached(SparkDeployError):
    """An automated repair was refused: the deployment was repaired too often in the past hour,
    so it is left for a person (the message names the earlier repairs)."""


class ReplaceRefused(SparkDeployError):
    """A deployment cannot be replaced: it could not be brought back if the new one failed."""


class RollbackFailed(SparkDeployError):
    """A replacing deploy failed and what it replaced could not be brought back either."""
