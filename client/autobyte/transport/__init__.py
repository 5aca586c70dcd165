"""The client's transport to autobyted: a session per process (`session`), the metrics stream
(`reporter`) and the control plane (`control`); it attaches itself to every ScheduledOptimizer."""
