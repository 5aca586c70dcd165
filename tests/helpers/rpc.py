"""Talking to a real daemon from tests: a raw client, metric samples and batches, a synthetic job."""

from __future__ import annotations

import time

import grpc
from autobyte.protocol import autobyte_pb2 as pb
from autobyte.protocol import autobyte_pb2_grpc as pb_grpc


class Client:
    def __init__(self, address: str, token: str | None = None) -> None:
        self.channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20),
            ],
        )
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.telemetry = pb_grpc.TelemetryStub(self.channel)
        self.control = pb_grpc.ControlStub(self.channel)
        self.query = pb_grpc.QueryStub(self.channel)

    def register(
        self, job="job", rank=0, world_size=2, instance="i-0", **kw
    ) -> pb.RegisterResponse:
        kw.setdefault("backend", "gloo")
        return self.telemetry.Register(
            pb.RegisterRequest(
                job=job, rank=rank, world_size=world_size, instance_id=instance, **kw
            ),
            timeout=10,
            metadata=self.metadata,
        )

    def stream(self, batches) -> list[int]:
        return [
            ack.acked_seq
            for ack in self.telemetry.StreamMetrics(
                iter(batches), timeout=30, metadata=self.metadata
            )
        ]

    def close(self) -> None:
        self.channel.close()


def sample(seq: int, step: int | None = None, **fields) -> pb.StepMetrics:
    values = {
        "seq": seq,
        "step": seq - 1 if step is None else step,
        "wall_time_s": time.time(),
        "step_time_s": 0.05,
        "forward_s": 0.01,
        "backward_s": 0.02,
        "exposed_comm_s": 0.005,
        "bytes_reduced": 1 << 20,
        "partitions": 4,
        "bandwidth_bytes_per_s": 1e8,
    }
    values.update(fields)
    return pb.StepMetrics(**values)


def batch(session_id: str, seqs, job="job", rank=0, **fields) -> pb.MetricsBatch:
    return pb.MetricsBatch(
        job=job, rank=rank, session_id=session_id, samples=[sample(s, **fields) for s in seqs]
    )


MIB = 1 << 20


# The model a SyntheticJob registers: 24 MB of gradients in 12 tensors
SYNTHETIC_MODEL = pb.ModelFingerprint(
    parameter_count=6_000_000,
    parameter_bytes=24_000_000,
    tensor_count=12,
    largest_tensor_bytes=8_000_000,
    median_tensor_bytes=1_000_000,
    digest="synthetic",
)


class SyntheticJob:
    """Streams rank 0's samples of a job over gRPC; step times do not depend on the configuration
    and the job never applies a decision unless told to (`applied`). It registers as a real client
    would (a model, a measured per-collective latency) and starts where any tuner tries something:
    64 KiB partitions of its 24 MB of gradients, 366 all-reduces a step, most of the step spent
    waiting on them."""

    def __init__(self, client: Client, job: str = "job", **register) -> None:
        self.client, self.job = client, job
        register.setdefault("model", SYNTHETIC_MODEL)
        register.setdefault("collective_latency_s", 5e-4)
        self.session = client.register(job=job, rank=0, world_size=2, **register).session_id
        self.seq = 0
        self.config = pb.Config(partition_bytes=64 << 10, credit_bytes=64 << 10)
        self.decision_id = 0
        self.wall = time.time()

    def steps(self, n: int, step_time_s: float = 0.1, **fields) -> None:
        fields = {
            "bytes_reduced": SYNTHETIC_MODEL.parameter_bytes,
            "partitions": 366,
            "exposed_comm_s": 0.06,
            **fields,
        }
        samples = []
        for _ in range(n):
            self.seq += 1
            self.wall += step_time_s
            samples.append(
                sample(
                    self.seq,
                    wall_time_s=min(self.wall, time.time() + 3600),
                    step_time_s=step_time_s,
                    config=self.config,
                    decision_id=self.decision_id,
                    **fields,
                )
            )
        self.client.stream(
            [pb.MetricsBatch(job=self.job, rank=0, session_id=self.session, samples=samples)]
        )

    def history(self):
        return self.client.query.History(pb.HistoryRequest(job=self.job, limit=1), timeout=10)

    def tuner(self):
        (status,) = [
            j
            for j in self.client.query.Status(pb.StatusRequest(), timeout=10).jobs
            if j.job == self.job
        ]
        return status.tuner
