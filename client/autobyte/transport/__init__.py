"""The client's transport to autobyted: a session per process (`session`: init/shutdown, attach,
rank placement, model fingerprint), the metrics stream (`reporter`: buffer, seq/ack, failover send
loop) and the control plane (`control`: watch, apply, report applied). It attaches itself to every
ScheduledOptimizer through `autobyte.hooks`; the scheduler never imports it."""

from autobyte.transport.reporter import Reporter
from autobyte.transport.session import RankPlace, init, model_fingerprint, shutdown

__all__ = ["RankPlace", "Reporter", "init", "model_fingerprint", "shutdown"]
