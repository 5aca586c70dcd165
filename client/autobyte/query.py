"""A Python client of autobyted: what `autobyte status`, `history`, `best`, `tune` and `propose`
show, as typed records (autobyte.records), for scripts and notebooks.

    from autobyte.query import Client, DaemonError

    client = Client("localhost:7077")                 # or AUTOBYTE_DAEMON / AUTOBYTE_TOKEN
    for job in client.status().jobs:
        print(job.job, job.config.short(), job.tuner.detail)
    best = client.best(client.resolve("gpt2"))        # a unique prefix of a job id
    client.propose(best.job, best.config, reason="pin the best")   # pauses the tuner for the job
    client.set_tuning(best.job, paused=False)

Every failure raises `DaemonError`: `kind` says which ("unreachable": no daemon answered at any
address, or what answered is not autobyted; "error": the daemon answered with an error, such as an
unknown job, a wrong token or its database failing; "usage": a bad address or an ambiguous job
prefix), and the message says what to do. Several daemons sharing one database are asked in order
until one answers (`daemon="host1:7077,host2:7077"`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import grpc

from autobyte.channel import auth_metadata, daemon_addresses, daemon_token, open_channel
from autobyte.convert import (
    best_from_proto,
    config_to_proto,
    decision_from_proto,
    history_step_from_proto,
    job_status_from_proto,
    tuner_status_from_proto,
)
from autobyte.protocol import autobyte_pb2 as pb
from autobyte.protocol import autobyte_pb2_grpc as pb_grpc
from autobyte.records import (
    BestRecord,
    DecisionRecord,
    HistoryStep,
    JobRecord,
    TunerStatusRecord,
)
from autobyte.types import Config

RPC_TIMEOUT_S = 10.0
KINDS = ("unreachable", "error", "usage")


class DaemonError(Exception):
    """A call that failed; `kind` is one of KINDS (see the module's docstring)."""

    def __init__(self, message: str, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"DaemonError kind {kind!r}: one of {KINDS}")
        super().__init__(message)
        self.kind = kind


@dataclasses.dataclass(frozen=True)
class Status:
    """Every job the daemon knows, and the daemon's version."""

    jobs: tuple[JobRecord, ...]
    daemon_version: str


@dataclasses.dataclass(frozen=True)
class History:
    """A job's decisions (oldest first) and, when asked for, its step records."""

    job: str
    decisions: tuple[DecisionRecord, ...]
    steps: tuple[HistoryStep, ...] = ()


class Client:
    """The daemons to ask, in order (several share one database: any of them answers)."""

    def __init__(
        self,
        daemon: str | None = None,
        token: str | None = None,
        tls_ca: str | None = None,
        timeout_s: float = RPC_TIMEOUT_S,
    ) -> None:
        """daemon: HOST:PORT, or several separated by commas (default: AUTOBYTE_DAEMON, else
        127.0.0.1:7077); token: the shared token (default: AUTOBYTE_TOKEN); tls_ca: a PEM CA
        certificate when the daemon uses TLS."""
        try:
            self.addresses = daemon_addresses(daemon)
        except ValueError as error:
            raise DaemonError(str(error), "usage") from None
        self.metadata = auth_metadata(daemon_token(token))
        self.tls_ca = tls_ca
        self.timeout_s = timeout_s

    # ------------------------------------------------------------------ queries

    def status(self) -> Status:
        response = self._call(pb_grpc.QueryStub, "Status", pb.StatusRequest())
        return Status(
            tuple(job_status_from_proto(j) for j in response.jobs), response.daemon_version
        )

    def history(
        self,
        job: str,
        since_s: float = 0.0,
        steps: bool = False,
        rank: int | None = None,
        limit: int = 1000,
    ) -> History:
        """The decisions of `job` made after `since_s` (unix time); with `steps`, also the latest
        `limit` step records (of `rank` only, when given), oldest first."""
        # Without steps one step record is asked for (the request has no "none") and dropped.
        request = pb.HistoryRequest(job=job, since_s=since_s, limit=limit if steps else 1)
        if rank is not None:
            request.rank = rank
        response = self._call(pb_grpc.QueryStub, "History", request)
        return History(
            response.job or job,
            tuple(decision_from_proto(d) for d in response.decisions),
            tuple(history_step_from_proto(s) for s in response.steps) if steps else (),
        )

    def best(self, job: str) -> BestRecord:
        """The best configuration measured on `job` in its latest context (`found` False: none yet,
        `evidence` says why)."""
        return best_from_proto(self._call(pb_grpc.QueryStub, "Best", pb.BestRequest(job=job)))

    def resolve(self, given: str) -> str:
        """The job `given` names: itself when the daemon knows a job of that id, else the one job
        whose id starts with it (as git takes a commit's prefix); several such jobs raise a usage
        error listing them; none: `given` as it is (the daemon answers for an unknown job)."""
        jobs = [j.job for j in self._call(pb_grpc.QueryStub, "Status", pb.StatusRequest()).jobs]
        if given in jobs:
            return given
        matches = sorted(j for j in jobs if j.startswith(given))
        if len(matches) > 1:
            raise DaemonError(
                f"job prefix {given!r} is ambiguous: it starts {len(matches)} jobs ("
                f"{', '.join(matches[:10])}{', ...' if len(matches) > 10 else ''}); give more of "
                "the id",
                "usage",
            )
        return matches[0] if matches else given

    # ------------------------------------------------------------------ control

    def propose(
        self, job: str, config: Config, at_step: int = 0, reason: str = "operator request"
    ) -> DecisionRecord:
        """Ask `job` to switch to `config` at `at_step` (0: the next step; a step already passed:
        the next too), stored as a decision; the tuner is paused for the job until
        `set_tuning(job, paused=False)`."""
        return decision_from_proto(
            self._call(
                pb_grpc.ControlStub,
                "ProposeConfig",
                pb.ProposeConfigRequest(
                    job=job, config=config_to_proto(config), apply_at_step=at_step, reason=reason
                ),
            )
        )

    def set_tuning(self, job: str, paused: bool) -> TunerStatusRecord | None:
        """Pause the tuner for `job` (it keeps the configuration in effect) or hand the job back to
        it; the tuner's status after it (None: the tuner has not looked at the job yet)."""
        status = self._call(
            pb_grpc.ControlStub, "SetTuning", pb.SetTuningRequest(job=job, paused=paused)
        )
        return tuner_status_from_proto(status) if status.known else None

    # ------------------------------------------------------------------ the call

    def _call(self, stub_type: Any, method: str, request: Any) -> Any:
        unreachable, foreign = [], []
        for address in self.addresses:
            with open_channel(address, self.tls_ca) as channel:
                try:
                    return getattr(stub_type(channel), method)(
                        request, timeout=self.timeout_s, metadata=self.metadata
                    )
                except grpc.RpcError as error:
                    code = error.code()
                    why = not_autobyted(
                        error, f"{stub_type.__name__.removesuffix('Stub')}.{method}"
                    )
                    if why is not None:
                        foreign.append((address, why))
                        continue  # as an unreachable daemon: the next one may be autobyted
                    # Only a transport failure means "cannot reach" (then the next daemon is asked):
                    # an error the daemon sends (its database failed: INTERNAL) is its message.
                    if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise DaemonError(f"{error.details()} [{code.name}]", "error") from None
                    unreachable.append(f"{address} ({code.name.lower()})")
        problems = [f"the service at {address} is not autobyted: {why}" for address, why in foreign]
        if unreachable:
            problems.append(f"cannot reach autobyted at {', '.join(unreachable)}; is it running?")
        raise DaemonError(
            "; ".join(problems)
            + (
                " (autobyted start, or set --daemon / AUTOBYTE_DAEMON)"
                if unreachable
                else "; set --daemon / AUTOBYTE_DAEMON to autobyted's HOST:PORT"
            ),
            "unreachable",
        )


def not_autobyted(error: grpc.RpcError, call: str) -> str | None:
    """Why the peer that gave `error` is not autobyted (None: autobyted's answer, or no answer):
    a gRPC server without autobyte's services (UNIMPLEMENTED), an HTTP/2 server that is no gRPC
    server (an HTTP status where gRPC's status should be), an HTTP/1.x server."""
    details = error.details() or ""
    if "http1.x server" in details or "Failed parsing HTTP/2" in details:
        return "it does not speak HTTP/2, as a gRPC server does (an HTTP/1.x server?)"
    if "Received http2 header with status" in details:
        status = details.rpartition("status:")[2].strip()
        return f"it speaks HTTP/2 but not gRPC (it answered HTTP status {status})"
    if error.code() == grpc.StatusCode.UNIMPLEMENTED:
        return f"it does not serve autobyte's {call} ({details} [UNIMPLEMENTED])"
    return None
