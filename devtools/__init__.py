"""Throwaway local infrastructure that tests/ and benchmarks/ both use (neither imports the other).

`devtools.ports.free_port` (a free loopback port) and `devtools.pgcluster.PgCluster` (a throwaway
PostgreSQL cluster). Not shipped in the wheel; the product never imports it.
"""
