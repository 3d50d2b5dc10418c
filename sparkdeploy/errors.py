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


class RemoteError(SparkDeployError):
    """A command on a node failed (not reachable, non-zero exit, timeout)."""


class TransientRemoteError(RemoteError):
    """A remote failure worth retrying: connection reset, timeout, 5xx."""


class EngramError(SparkDeployError):
    """An Engram config, a safetensors shard or a rank's byte ranges are inconsistent."""


class PrefetchError(SparkDeployError):
    """A repo cannot be put into the NAS HF cache: not found, gated, no space, corrupt on the hub."""


class TransientPrefetchError(PrefetchError):
    """A hub failure worth retrying: connection refused/reset, timeout, 5xx."""


class LabError(SparkDeployError):
    """The lab cluster cannot be brought up, inspected or torn down."""


class StagingError(SparkDeployError):
    """An Engram sparse copy cannot be made or verified on a node."""


class ComposeError(SparkDeployError):
    """A node's composed HF cache (NAS symlinks + local hardlinks) cannot be built."""
