"""Which nodes an ``autoplan run`` spans, and the torchrun options that join their ranks.

One node (the default): ``torchrun --nnodes 1 --master-addr 127.0.0.1 --master-port P``, as
before. ``N > 1`` nodes: the same ``autoplan run`` command on every node, each launching its
``--nproc-per-node`` local ranks with ``torchrun --nnodes N --rdzv-backend c10d --rdzv-endpoint
HOST:PORT --rdzv-id ID``. That is torchrun's documented multi-node recipe (``torch/distributed/
run.py``, "Note on rendezvous backend": ``--rdzv-id``, ``--rdzv-backend``, ``--rdzv-endpoint``,
"c10d (recommended)"): the agent on the host named by the endpoint serves the store itself (no
separate server), the nodes may start in any order, ``--max-restarts`` restarts every node's
ranks together, and torchrun ranks the nodes itself. torchrun's static rendezvous (``--node-rank``
with ``--master-addr``/``--master-port``) is its legacy ``torch.distributed.launch`` path: it needs
every node's rank right and cannot restart a group. So ``--node-rank`` is accepted and checked
(``0 <= K < N``, as scripts written for the static path pass it) but not forwarded: with c10d
torchrun ignores it, and global rank 0 (which prints the loss lines and writes ``--save-final``)
is on whichever node the rendezvous puts first. The ranks of one node are consecutive, so a plan
for ``N`` nodes of ``M`` devices keeps its within-node axes within a node.

Under SLURM, inside an ``srun`` step (``SLURM_STEP_ID`` is set; a batch script outside ``srun`` is
one process on one node and is left alone), a flag that is absent is read from the environment:

* ``--nnodes``: ``SLURM_STEP_NUM_NODES``, else ``SLURM_NNODES``;
* ``--node-rank``: ``SLURM_NODEID``;
* ``--rdzv-id``: ``SLURM_JOB_ID`` (default outside SLURM: ``autoplan``; the endpoint already
  separates jobs, the id only has to be the same on every node);
* ``--rdzv-endpoint``: ``MASTER_ADDR[:MASTER_PORT]`` when ``MASTER_ADDR`` is set (with or without
  SLURM), else the first host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``), expanded by
  ``scontrol show hostnames`` when it is a range like ``node[01-04]``, with port
  ``MASTER_PORT`` or torchrun's default 29400.

``srun`` must start one task per node (``--ntasks-per-node=1``): each ``autoplan run`` launches
its node's ranks itself. Importing this module loads no torch (CLI start-up).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from autoplan.cost_models.echo import clip_text
from autoplan.cost_models.errors import PlanError, PlanMismatchError
from autoplan.tools import common
from autoplan.tools.launch import DEFAULT_JOIN_TIMEOUT_S, Rendezvous

DEFAULT_RDZV_PORT = 29400
"""torchrun's port of a ``--rdzv-endpoint`` given without one (``torch/distributed/run.py`` docs)."""
DEFAULT_RDZV_ID = "autoplan"
SCONTROL_TIMEOUT_S = 30.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Nodes:
    """The nodes of one run and how their torchrun agents meet."""

    num_nodes: int
    """``--nnodes``: 1 runs on this machine alone."""
    node_rank: int
    """``--node-rank``, checked ``0 <= node_rank < num_nodes``; torchrun's c10d rendezvous ranks the nodes itself."""
    nproc_per_node: int | None
    """``--nproc-per-node``; ``None``: the plan's world size divided by ``num_nodes``."""
    rdzv_endpoint: str | None
    """``HOST:PORT`` of the c10d rendezvous store (``N > 1``); ``None`` on one node."""
    rdzv_id: str
    """The job id every node's torchrun joins under."""

    def __str__(self) -> str:
        if self.num_nodes == 1:
            return "1 node"
        return f"node {self.node_rank} of {self.num_nodes} (rendezvous {self.rdzv_endpoint}, id {self.rdzv_id})"

    def ranks_per_node(self, world_size: int, *, what: str) -> int:
        """The local ranks each node launches for ``world_size`` devices (``what``: where that
        number comes from, for the message); PlanMismatchError unless ``num_nodes`` of them make it."""
        nproc, num_nodes = self.nproc_per_node, self.num_nodes
        if nproc is not None and nproc * num_nodes == world_size:
            return nproc
        if nproc is None and world_size % num_nodes == 0:
            return world_size // num_nodes
        fix = (
            f"--nproc-per-node {world_size // num_nodes}"
            if world_size % num_nodes == 0
            else f"--nnodes dividing {world_size}"
        )
        launched = (
            f"--nnodes {num_nodes} x --nproc-per-node {nproc} = {nproc * num_nodes} ranks"
            if nproc
            else f"--nnodes {num_nodes} cannot share them equally"
        )
        raise PlanMismatchError(
            f"{what} has {world_size} devices but {launched}: give {fix}, or re-plan for the ranks you launch"
        )

    def check_endpoint_resolves(self) -> None:
        """The host of ``rdzv_endpoint`` has an address (``socket.getaddrinfo``); PlanError
        naming it if not, rather than torchrun retrying the rendezvous for minutes."""
        if self.rdzv_endpoint is None:
            return
        host, _, port = self.rdzv_endpoint.rpartition(":")
        try:
            socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:  # socket.gaierror is an OSError
            reason = getattr(exc, "strerror", None) or str(exc)
            raise PlanError(
                f"rendezvous host {clip_text(host, 80)!r} (--rdzv-endpoint {clip_text(self.rdzv_endpoint, 100)}) does not "
                f"resolve ({clip_text(reason, 80)}): give a host name or address every node can reach"
            ) from None

    def rendezvous(self, join_timeout_s: float) -> Rendezvous | None:
        """Where several nodes meet (``None`` on one node)."""
        if self.rdzv_endpoint is None:
            return None
        return Rendezvous(
            endpoint=self.rdzv_endpoint, run_id=self.rdzv_id, num_nodes=self.num_nodes, join_timeout_s=join_timeout_s
        )

    def torchrun_env(self) -> dict[str, str]:
        """Environment for torchrun on several nodes: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
        (torch's switch, ``DynamicRendezvousHandler.use_agent_store``) gives each rendezvous round
        a fresh store, hosted by rank 0 on a port the round picks. By default the ranks would
        share the rendezvous store, which outlives the rounds, under a key prefix per
        ``TORCHELASTIC_RESTART_COUNT`` (``autoplan/tools/worker.py``), but each node's agent
        counts its own restarts, and a node restarted because another one rejoined does not
        count it ("membership changes do not count as retries"). The prefixes then differ across
        nodes, and under ``--max-restarts`` a restarted rank reads a dead rank's address (gloo:
        connection refused). Seen with two nodes, a rank killed after step 2, ``--max-restarts
        1``: refused without the switch; with it, the job resumes and ends equal to the single
        device."""
        return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if self.num_nodes > 1 else {}

    def torchrun_args(
        self, *, nproc_per_node: int, master_port: int | None, join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    ) -> list[str]:
        """torchrun's options for this node's ranks (before the ``-m MODULE`` to run); several
        nodes wait ``join_timeout_s`` for each other (``--rdzv-conf join_timeout=``)."""
        if self.num_nodes == 1:
            assert master_port is not None, "one node meets at 127.0.0.1:master_port"
            return ["--nproc-per-node", str(nproc_per_node), "--nnodes", "1",
                    "--master-addr", "127.0.0.1", "--master-port", str(master_port)]  # fmt: skip
        assert self.rdzv_endpoint is not None, "several nodes meet at an endpoint"
        return ["--nproc-per-node", str(nproc_per_node), "--nnodes", str(self.num_nodes),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", self.rdzv_endpoint, "--rdzv-id", self.rdzv_id,
                "--rdzv-conf", f"join_timeout={join_timeout_s:g}"]  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``, ``--rdzv-id``, ``--nproc-per-node`` (torchrun's names)."""
    p.add_argument("--nnodes", type=common.positive_int, help="nodes of the job (default: 1, or SLURM's in srun)")
    p.add_argument(
        "--node-rank",
        type=common.non_negative_int,
        help="this node's index 0..N-1 (checked; torchrun's c10d rendezvous ranks the nodes itself)",
    )
    p.add_argument(
        "--rdzv-endpoint",
        metavar="HOST[:PORT]",
        help=f"with --nnodes N > 1: the host serving torchrun's c10d rendezvous (default port {DEFAULT_RDZV_PORT}; "
        "default: MASTER_ADDR[:MASTER_PORT], or the first node of SLURM's nodelist in srun)",
    )
    p.add_argument(
        "--rdzv-id",
        help=f"job id, the same on every node (default: SLURM_JOB_ID in srun, else {DEFAULT_RDZV_ID!r})",
    )
    p.add_argument(
        "--nproc-per-node",
        type=common.positive_int,
        help="ranks per node (default: the plan's world size / --nnodes)",
    )


def nodes_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> Nodes:
    """The nodes of ``autoplan run``: each absent flag read from SLURM inside an ``srun`` step or,
    for the endpoint, ``MASTER_ADDR``; PlanError naming the option (or variable) and the fix."""
    slurm = "SLURM_STEP_ID" in env
    num_nodes, nodes_from = args.nnodes, "--nnodes"
    if num_nodes is None and slurm:
        nodes_from = "SLURM_STEP_NUM_NODES" if "SLURM_STEP_NUM_NODES" in env else "SLURM_NNODES"
        num_nodes = _env_int(env, nodes_from, minimum=1)
    num_nodes = num_nodes or 1
    node_rank, rank_from = args.node_rank, "--node-rank"
    if node_rank is None and slurm and "SLURM_NODEID" in env:
        node_rank, rank_from = _env_int(env, "SLURM_NODEID", minimum=0), "SLURM_NODEID"
    node_rank = node_rank or 0
    if node_rank >= num_nodes:
        raise PlanError(
            f"{rank_from} {node_rank} is out of range for {nodes_from} {num_nodes}: give a node rank in 0..{num_nodes - 1}"
        )
    if num_nodes == 1:
        for option in ("rdzv_endpoint", "rdzv_id"):
            if getattr(args, option) is not None:
                flag = "--" + option.replace("_", "-")
                raise PlanError(f"{flag} joins several nodes: give --nnodes N > 1 with it, or drop it for one node")
        return Nodes(num_nodes=1, node_rank=0, nproc_per_node=args.nproc_per_node, rdzv_endpoint=None, rdzv_id="")
    if args.master_port is not None:
        raise PlanError(
            f"--master-port is the port of a one-node run on 127.0.0.1; with {nodes_from} {num_nodes} "
            "give --rdzv-endpoint HOST:PORT instead"
        )
    if slurm:
        _check_one_task_per_node(env, num_nodes)
    return Nodes(
        num_nodes=num_nodes,
        node_rank=node_rank,
        nproc_per_node=args.nproc_per_node,
        rdzv_endpoint=_endpoint(args.rdzv_endpoint, env, slurm=slurm, num_nodes=num_nodes),
        rdzv_id=args.rdzv_id or (env.get("SLURM_JOB_ID") if slurm else None) or DEFAULT_RDZV_ID,
    )


def _env_int(env: Mapping[str, str], name: str, *, minimum: int) -> int:
    text = env[name].strip()
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise PlanError(
            f"{name}={clip_text(text, 40)!r} is not an integer >= {minimum}: fix the environment or give the flag"
        )
    return value


def _check_one_task_per_node(env: Mapping[str, str], num_nodes: int) -> None:
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if tasks is not None and tasks.strip() != str(num_nodes):
        raise PlanError(
            f"srun started {clip_text(tasks, 20)} tasks on {num_nodes} nodes, but `autoplan run` launches its node's "
            "ranks itself: run it with srun --ntasks-per-node=1"
        )


def parse_endpoint(text: str, *, option: str = "--rdzv-endpoint") -> str:
    """``HOST[:PORT]`` (an IPv6 address in brackets, ``[::1]:29400``) as ``HOST:PORT``, the port
    defaulting to torchrun's :data:`DEFAULT_RDZV_PORT`; PlanError naming ``option`` when malformed."""
    shown = clip_text(text, 80)
    text = text.strip()
    port_text: str | None
    if text.startswith("["):  # [IPv6]:PORT
        host, bracket, rest = text.partition("]")
        host += bracket
        if not bracket or (rest and not rest.startswith(":")):
            host = ""
        port_text = rest[1:] if rest.startswith(":") else None
    else:
        host, colon, port_text = text.partition(":")
        port_text = port_text if colon else None
    if host in ("", "[]") or any(c.isspace() for c in host):
        raise PlanError(f"{option} {shown!r} is malformed: expected HOST[:PORT] like node1:29400 (IPv6: [ADDR]:PORT)")
    if port_text is None:
        return f"{host}:{DEFAULT_RDZV_PORT}"
    if not (port_text.isascii() and port_text.isdigit() and 1 <= int(port_text) <= 65535):
        raise PlanError(f"{option} {shown!r}: port {clip_text(port_text, 20)!r} is not in 1..65535: give HOST:PORT")
    return f"{host}:{int(port_text)}"


def _endpoint(flag: str | None, env: Mapping[str, str], *, slurm: bool, num_nodes: int) -> str:
    """``--rdzv-endpoint``, else ``MASTER_ADDR[:MASTER_PORT]``, else (in ``srun``) the first node."""
    if flag is not None:
        return parse_endpoint(flag)
    port = env.get("MASTER_PORT", str(DEFAULT_RDZV_PORT))
    if env.get("MASTER_ADDR"):
        return parse_endpoint(f"{env['MASTER_ADDR']}:{port}", option="MASTER_ADDR:MASTER_PORT")
    nodelist = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "").strip() if slurm else ""
    if not nodelist:
        raise PlanError(
            f"--nnodes {num_nodes} needs --rdzv-endpoint HOST[:PORT], HOST being one of the nodes (the same on "
            "every node), or MASTER_ADDR set, or an srun step with SLURM_JOB_NODELIST"
        )
    return parse_endpoint(f"{_first_host(nodelist)}:{port}", option="the first node of SLURM's nodelist")


def _first_host(nodelist: str) -> str:
    """The first host of a SLURM nodelist: a plain ``a,b`` list is split here, a range like
    ``node[01-04]`` is expanded by ``scontrol show hostnames``."""
    if "[" not in nodelist:
        return nodelist.split(",")[0].strip()
    shown = clip_text(nodelist, 80)
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise PlanError(
            f"SLURM nodelist {shown!r} is a range and `scontrol` is not on PATH to expand it: "
            "give --rdzv-endpoint HOST:PORT (HOST: the first node) or set MASTER_ADDR"
        )
    try:
        out = subprocess.run(
            [scontrol, "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise PlanError(
            f"`scontrol show hostnames {shown}` failed ({clip_text(str(exc), 120)}): give --rdzv-endpoint HOST:PORT"
        ) from None
    hosts = out.split()
    if not hosts:
        raise PlanError(f"`scontrol show hostnames {shown}` printed no host: give --rdzv-endpoint HOST:PORT")
    return hosts[0]
