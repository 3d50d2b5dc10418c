from __future__ import annotations

import http.client
import os
import time
from pathlib import Path
from urllib.parse import urlsplit

from prefect.settings import PREFECT_API_URL

from lab.prefect_local import PrefectServer, free_port

# uvicorn closes a connection idle this long unless told otherwise.
UVICORN_DEFAULT_KEEPALIVE_S = 5


def second_request_after_idling(api_url: str, idle_s: float) -> int:
    """GET /health twice on one connection, idle_s apart; the second answer's status."""
    address = urlsplit(api_url)
    assert address.hostname is not None
    assert address.port is not None
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
    try:
        connection.request("GET", f"{address.path}/health")
        connection.getresponse().read()
        time.sleep(idle_s)
        try:
            connection.request("GET", f"{address.path}/health")
            response = connection.getresponse()
            response.read()
        except (http.client.RemoteDisconnected, ConnectionError) as exc:
            raise AssertionError(
                f"the server closed a connection idle for {idle_s} s: {exc!r}"
            ) from exc
        return response.status
    finally:
        connection.close()


def test_the_test_server_outwaits_the_clients_idle_connections(prefect_harness: Path) -> None:
    assert (
        second_request_after_idling(PREFECT_API_URL.value(), UVICORN_DEFAULT_KEEPALIVE_S + 1.5)
        == 200
    )


def test_the_demo_server_starts_outwaits_idle_connections_and_stops(tmp_path: Path) -> None:
    server = PrefectServer(tmp_path / "prefect-home", port=free_port())
    with server:
        pid = server.pid
        assert pid is not None
        assert server.is_healthy()
        assert second_request_after_idling(server.api_url, UVICORN_DEFAULT_KEEPALIVE_S + 1.5) == 200
    assert not server.is_healthy()
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        pass
    else:
        raise AssertionError(f"a process of the server's group {pid} outlived stop()")
