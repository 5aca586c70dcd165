"""autobyted: the daemon that stores job telemetry, predicts good configurations and pushes them."""
