"""The zombie automation: its trigger, its guard, and applying it twice on a real server."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from prefect import get_client
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import EventTrigger, Posture

from sparkdeploy.errors import SparkDeployError
from sparkdeploy.report.zombies import (
    HEARTBEAT_EVENT,
    ZOMBIE_AUTOMATION,
    apply_zombie_automation,
    zombie_automation,
)


def test_a_run_three_heartbeats_silent_that_has_not_ended_is_crashed() -> None:
    automation = zombie_automation(30)
    trigger = automation.trigger
    assert isinstance(trigger, EventTrigger)
    assert trigger.posture == Posture.Proactive
    assert trigger.after == {HEARTBEAT_EVENT}
    assert HEARTBEAT_EVENT in trigger.expect
    assert "prefect.flow-run.Completed" in trigger.expect
    assert trigger.within == timedelta(seconds=90)
    assert trigger.for_each == {"prefect.resource.id"}
    [action] = automation.actions
    assert isinstance(action, ChangeFlowRunState)
    assert action.state == StateType.CRASHED


def test_the_default_silence_outlasts_prefects_default_heartbeat() -> None:
    trigger = zombie_automation().trigger
    assert isinstance(trigger, EventTrigger)
    assert trigger.within == timedelta(seconds=3 * 180)


def test_heartbeats_faster_than_prefect_sends_them_are_refused() -> None:
    with pytest.raises(SparkDeployError, match="PREFECT_FLOWS_HEARTBEAT_FREQUENCY"):
        zombie_automation(10)


def test_applying_it_twice_keeps_one_automation(prefect_harness: Path) -> None:
    with get_client(sync_client=True) as client:
        first = apply_zombie_automation(client, 30)
        assert apply_zombie_automation(client, 60) == first
        [automation] = client.read_automations_by_name(ZOMBIE_AUTOMATION)
        assert isinstance(automation.trigger, EventTrigger)
        assert automation.trigger.within == timedelta(seconds=180)
        client.delete_automation(first)
