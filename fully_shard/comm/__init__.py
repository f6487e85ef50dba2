"""Communication: every collective call, the streams and events they run on, torch's Comm protocol, the trace."""

from __future__ import annotations

from . import collectives, exchange, protocol, trace
from .streams import CommContext, Pending

__all__ = ["CommContext", "Pending", "collectives", "exchange", "protocol", "trace"]
