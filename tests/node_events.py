"""A stand-in for `driver.kube.kube_events.NodeEvents`: the Node Events posted, in order."""

from __future__ import annotations

from driver.kube.kube_events import NodeEvent


class RecordedNodeEvents:
    def __init__(self) -> None:
        self.posted: list[NodeEvent] = []

    def post(self, event: NodeEvent) -> None:
        self.posted.append(event)

    def start(self) -> None:
        pass

    def stop(self, timeout: float = 5.0) -> None:
        pass
