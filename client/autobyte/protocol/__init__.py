"""Generated gRPC protocol code (see protos/ and scripts/gen_protos.py)."""
