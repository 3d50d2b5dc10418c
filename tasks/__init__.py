"""The pipeline's Prefect tasks, one module per step. Every flow imports this package, so its
flow runs end as soon as their last task does (sparkdeploy.remote.prefect_api)."""

from sparkdeploy.remote.prefect_api import end_runs_without_waiting_for_heartbeats

end_runs_without_waiting_for_heartbeats()
