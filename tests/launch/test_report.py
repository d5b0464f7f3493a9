"""The report protocol over real TCP sockets: hello, exit instruction, bye; bad lines refused."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from hpcrl.launch.report import HEAD_LOST, ReportError, ReportServer, report_and_wait


def _events_until(server: ReportServer, count: int, timeout: float = 5.0) -> list:
    events, deadline = [], time.monotonic() + timeout
    while len(events) < count and time.monotonic() < deadline:
        events += server.poll(0.1)
    return events


def _reporting_task(server: ReportServer, identity: dict, **kw) -> tuple[threading.Thread, dict]:
    """A started thread running report_and_wait against `server`; its exit code lands in result["code"]."""
    result: dict = {}
    task = threading.Thread(target=lambda: result.update(code=report_and_wait(server.address, identity, **kw)))
    task.start()
    return task, result


@pytest.mark.timeout(20)
def test_a_task_reports_its_identity_and_exits_with_the_code_the_head_sends():
    server = ReportServer("127.0.0.1")
    task, result = _reporting_task(server, {"group": "trainer", "rank": 1}, pid=7)
    try:
        (hello,) = _events_until(server, 1)
        assert hello.message["type"] == "hello" and hello.message["identity"] == {"group": "trainer", "rank": 1}
        server.send(hello.conn, {"type": "exit", "code": 3})
        bye = _events_until(server, 1)[0]
        assert bye.message == {"v": 1, "type": "bye", "code": 3}
        task.join(5)
        assert result["code"] == 3
    finally:
        server.close()


@pytest.mark.timeout(20)
def test_a_given_exit_code_wins_over_the_head_and_is_told_to_it():
    server = ReportServer("127.0.0.1")
    task, result = _reporting_task(server, {"group": "reward", "rank": 0}, pid=1, given_code=4)
    try:
        (hello,) = _events_until(server, 1)
        server.send(hello.conn, {"type": "exit", "code": 0})
        assert _events_until(server, 1)[0].message["code"] == 4
        task.join(5)
        assert result["code"] == 4
    finally:
        server.close()


@pytest.mark.timeout(20)
def test_a_task_whose_head_goes_away_exits_with_head_lost():
    server = ReportServer("127.0.0.1")
    task, result = _reporting_task(server, {"group": "trainer", "rank": 0}, pid=1)
    _events_until(server, 1)
    server.close()
    task.join(5)
    assert result["code"] == HEAD_LOST


@pytest.mark.timeout(20)
def test_a_line_that_is_not_a_report_message_is_an_error_naming_the_peer():
    server = ReportServer("127.0.0.1")
    try:
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"\x80\x04pickle?\n")
            events = _events_until(server, 1)
        assert events[0].kind == "error" and "not JSON" in events[0].error and "127.0.0.1" in events[0].error
    finally:
        server.close()


def test_an_unreachable_head_is_an_error_with_its_address():
    server = ReportServer("127.0.0.1")
    address = server.address
    server.close()
    with pytest.raises(ReportError, match=address):
        report_and_wait(address, {}, pid=1, connect_timeout_s=2)
