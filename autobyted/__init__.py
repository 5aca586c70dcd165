"""autobyted: the daemon that stores job telemetry, serves it to the CLI and pushes the configuration
decisions proposed for a job to its ranks (it does not choose configurations by itself yet)."""
