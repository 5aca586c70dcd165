"""The job id of a training launch: the user's (`init(job=)`, AUTOBYTE_JOB), torchrun's `--rdzv-id`,
or, under plain torchrun (its run id is "none"), one derived from the launch that every rank of it
shares and a restarted worker of the same launch finds again."""

from __future__ import annotations

import datetime
import logging
import re
import secrets
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)

STORE_KEY = "autobyte/job_id"
STORE_TIMEOUT_S = 5.0


def job_id_for(job: str | None, environ: Mapping[str, str]) -> str:
    """`job`, else AUTOBYTE_JOB, else TORCHELASTIC_RUN_ID unless it is torchrun's "none", else one
    derived from the torchrun launch; ValueError outside torchrun with none of them."""
    if job:
        return job
    if environ.get("AUTOBYTE_JOB"):
        return environ["AUTOBYTE_JOB"]
    run_id = environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return run_id
    addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if run_id == "none" and addr and port:
        agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        derived, how = launch_job_id(addr, int(port), agent_store)
        log.info(
            "autobyte job id %r (%s); pass --rdzv-id to torchrun or set AUTOBYTE_JOB for an "
            "id that stays the same across launches",
            derived,
            how,
        )
        return derived
    raise ValueError(
        "autobyte.init needs a job id: pass job=... or set AUTOBYTE_JOB (under "
        "torchrun one is derived from the launch, or taken from --rdzv-id)"
    )


def launch_job_id(addr: str, port: int, agent_store: bool) -> tuple[str, str]:
    """(job id, how it was chosen). With torchrun's agent store (it lives as long as the launch, at
    MASTER_ADDR:MASTER_PORT), the first rank to ask draws an id and every rank, restarted ones too,
    reads that one. Without it, the rendezvous endpoint names the job."""
    endpoint = re.sub(r"[^A-Za-z0-9.-]", "-", f"{addr}-{port}")
    if agent_store:
        try:
            import torch.distributed as dist

            store = dist.TCPStore(
                addr, port, is_master=False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S)
            )
            candidate = f"torchrun-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
            chosen = store.compare_set(STORE_KEY, "", candidate)
            chosen = chosen.decode() if isinstance(chosen, bytes) else str(chosen)
            if chosen:
                return chosen, f"drawn for this torchrun launch at {addr}:{port}"
        except Exception as error:  # noqa: BLE001 - fall back to the endpoint, training goes on
            log.info(
                "torchrun's store at %s:%s did not answer (%s); the job id names the endpoint",
                addr,
                port,
                error,
            )
    return f"torchrun-{endpoint}", f"from the rendezvous endpoint {addr}:{port}"
