"""The fixture every test of Flower's messages needs: Flower stamps each ``Message`` it builds
with the identity of the task that runs it (its ServerApp or ClientApp process sets it), so
a test that builds messages in this process sets one (run 1, node 0, task 0) for its
duration. Without Flower installed it does nothing: the tests here skip themselves."""

from __future__ import annotations

from typing import Iterator

import pytest

try:
    from flwr.supercore.task_identity import TaskIdentity
except ImportError:   # no Flower here
    TaskIdentity = None


@pytest.fixture(autouse=True)
def task_identity() -> Iterator[None]:
    """Run 1, node 0, task 0 as the running task's identity, restored afterwards."""
    if TaskIdentity is None:
        yield
        return
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
