"""Where a run's parts run: the cluster backend (`cluster`; the trainer's ranks are
`train.world_size`, in `config.train`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from tiller.config.base import Section
from tiller.errors import ConfigError


class ClusterConfig(Section):
    """Where the run's parts run: in this machine's processes, or on a Ray cluster."""

    backend: Literal["local", "ray"] = Field("local", description="local: the rollout side in "
                                             "the run's process and extra trainer ranks as "
                                             "spawned processes; ray: the rollout workers, "
                                             "managed engine servers and trainer ranks as Ray "
                                             "actors (the ray extra)")
    address: str | None = Field(None, description="with backend ray: an existing cluster's "
                                "address (`ray start --head` prints it, e.g. 10.0.0.1:6379); "
                                "none: a local Ray instance is started for the run and stopped "
                                "with it")
    num_cpus: int | None = Field(None, ge=1, description="with backend ray and no address: the "
                                 "CPUs the local Ray instance may use (default: os.cpu_count())")
    object_store_mb: int = Field(256, ge=75, description="with backend ray and no address: the "
                                 "local Ray instance's object store, MiB (Ray's minimum: 75; "
                                 "refused when not "
                                 "the default otherwise: it would have no effect)")
    rollout_workers: int = Field(1, ge=1, description="with backend ray: Ray actors that run the "
                                 "episodes, one CPU each: each holds an embedded engine (a copy "
                                 "of the weights every sync updates) or, with engine servers "
                                 "(engine.backend http, vllm, sglang), an HTTP client of them "
                                 "(on the run's node: managed servers listen on loopback), and "
                                 "runs agent loops, envs "
                                 "and tools (its own tool stack: tool concurrency limits and "
                                 "caches are per worker); its "
                                 "torch uses 1 thread, the CPU it reserves, whatever "
                                 "runtime.threads says (that sets the run's own process); an "
                                 "episode whose worker dies is retried on another "
                                 "(ledger/retried), at most twice")

    @field_validator("address")
    @classmethod
    def _host_port(cls, address: str | None) -> str | None:
        """HOST:PORT of a cluster's GCS (`[v6]:PORT` too); Ray Client (`ray://`) and Ray's
        `auto` (the last cluster `ray start` left on this machine) are not taken."""
        if address is None:
            return None
        host, _, port = address.rpartition(":")
        why = ("Ray Client (ray://) is not supported" if address.startswith("ray://") else
               None if host.strip("[]") and port.isdigit() else "expected HOST:PORT")
        if why:
            raise ConfigError(f"config field cluster.address: got {address!r}; {why}: give "
                              f"the cluster's GCS address HOST:PORT, as `ray start --head` "
                              f"prints it (e.g. 10.0.0.1:6379)")
        return address
