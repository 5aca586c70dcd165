"""Persistent history of jobs, ranks, step metrics, configurations and decisions."""
