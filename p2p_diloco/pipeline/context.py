"""The torch.distributed process group that joins the P stage processes of one peer.

A stage process finds its place from the torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK), set by
``torchrun`` across the nodes of a cluster or by our local launcher (:mod:`p2p_diloco.pipeline.launch`). gloo on
CPU, NCCL on CUDA. Every collective that fails because a stage of the peer died becomes a :class:`PipelineError`
with a message saying so. Only stages of one peer talk through this group; between peers, only hivemind.

The stages meet through a store that has no authentication, and object collectives unpickle what they receive, so
whoever reaches the store can run code in every stage. torch's ``TCPStore`` listens on all interfaces whatever
``MASTER_ADDR`` says, so our local launcher uses none: it names a ``FileStore`` in a private (0700) directory
(:data:`STORE_FILE`), checked here, and binds gloo's and NCCL's sockets to the loopback interface. Under torchrun
(MASTER_ADDR, MASTER_PORT) the store is torch's ``TCPStore``: keep MASTER_PORT on a private network or firewalled;
gloo's sockets are bound to this machine's interface towards MASTER_ADDR (:func:`interface_towards`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from p2p_diloco.config import ConfigError

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # torchrun's
STORE_FILE = "P2P_DILOCO_STORE_FILE"  # our local launcher's instead of MASTER_ADDR and MASTER_PORT
logger = logging.getLogger(__name__)


class PipelineError(RuntimeError):
    """A stage of this peer stopped answering (died, or its link broke): the whole peer must stop."""


def launched_as_stage() -> bool:
    """Whether this process was started as one stage of a pipeline (by torchrun or our launcher)."""
    keys = ENV_KEYS[:3] + ((STORE_FILE,) if STORE_FILE in os.environ else ENV_KEYS[3:])
    return all(key in os.environ for key in keys)


@dataclass
class PipelineContext:
    """This stage process's place in its peer's pipeline and the process group joining the stages."""

    stage_index: int
    num_stages: int
    local_rank: int
    device: torch.device
    replica_index: int = 0
    num_replicas: int = 1
    pipeline_group: Any = None
    """This replica's P stages (None: the whole world, when the peer has one replica)."""
    replica_group: Any = None
    """This stage's D replicas (None when D = 1): DDP's gradient all-reduce and replica 0's weights."""

    @classmethod
    def from_environment(cls, num_stages: int, device_spec: str, timeout_s: float,
                         replicas: int = 1) -> PipelineContext:
        """Join the peer's process group (blocks until all D x P processes are up, at most ``timeout_s``). Rank r is
        stage r mod P of replica r div P."""
        rank, world, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        if world != num_stages * replicas:
            raise ConfigError(f"pipeline.stages: is {num_stages} (x pipeline.replicas {replicas}) but {world} "
                              "processes were launched (torchrun --nproc-per-node x --nnodes must equal the number "
                              "of stages times the replicas)")
        device = _stage_device(device_spec, local_rank)
        check_one_gpu_per_stage(device, device_spec, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = timedelta(seconds=timeout_s)
        store = _private_store(world, timeout)
        if store is None and backend == "gloo":
            _bind_gloo_towards(os.environ["MASTER_ADDR"])
        try:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, store=store)
            pipeline_group = replica_group = None
            if replicas > 1:  # every process creates every group, in the same order
                for d in range(replicas):
                    group = dist.new_group([d * num_stages + j for j in range(num_stages)])
                    if d == rank // num_stages:
                        pipeline_group = group
                for j in range(num_stages):
                    group = dist.new_group([d * num_stages + j for d in range(replicas)])
                    if j == rank % num_stages:
                        replica_group = group
        except Exception as e:
            raise PipelineError(f"process {rank} could not join its peer's other processes: {e}") from None
        return cls(rank % num_stages, num_stages, local_rank, device, rank // num_stages, replicas, pipeline_group,
                   replica_group)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of stage ``src`` on every stage (of this replica)."""
        box = [obj]
        self._guard(dist.broadcast_object_list, box, src=self._global(src), group=self.pipeline_group)
        return box[0]

    def all_gather_objects(self, obj: Any) -> list[Any]:
        out = [None] * self.num_stages
        self._guard(dist.all_gather_object, out, obj, group=self.pipeline_group)
        return out

    def _global(self, stage: int) -> int:
        """The global rank of stage ``stage`` of this replica."""
        return self.replica_index * self.num_stages + stage

    # ---- between the replicas of this stage (replica 0 leads: p2p_diloco.pipeline.replicas) ------------------
    def to_replicas(self, obj: Any) -> Any:
        """Replica 0's ``obj`` on every replica of this stage."""
        box = [obj]
        self._guard(dist.broadcast_object_list, box, src=self.stage_index, group=self.replica_group)
        return box[0]

    def tensors_to_replicas(self, tensors: list[torch.Tensor]) -> None:
        """Replica 0's values of ``tensors`` written into every replica's, in place."""
        for tensor in tensors:
            self._guard(dist.broadcast, tensor.data, src=self.stage_index, group=self.replica_group)

    def gather_1d(self, values: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate each stage's 1-D ``values`` (stage j has ``sizes[j]`` entries) in stage order."""
        width = max(sizes)
        padded = torch.zeros(width, dtype=values.dtype, device=self.device)
        padded[: values.numel()] = values
        parts = [torch.empty_like(padded) for _ in range(self.num_stages)]
        self._guard(dist.all_gather, parts, padded, group=self.pipeline_group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])

    def any_flag(self, flag: bool) -> bool:
        return self.any_flags((flag,))[0]

    def any_flags(self, flags: tuple[bool, ...]) -> tuple[bool, ...]:
        """For each flag, whether any stage raised it (one collective for all of them)."""
        value = torch.tensor([1.0 if flag else 0.0 for flag in flags], device=self.device)
        self._guard(dist.all_reduce, value, op=dist.ReduceOp.MAX, group=self.pipeline_group)
        return tuple(bool(v > 0) for v in value.tolist())

    def barrier(self) -> None:
        self._guard(dist.barrier, group=self.pipeline_group)

    def _guard(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, dist.DistError) as e:
            raise PipelineError(f"stage {self.stage_index}: another stage of this peer is gone ({_short(e)})") from None

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _private_store(world: int, timeout: timedelta):
    """Our local launcher's ``FileStore`` (None under torchrun: torch's ``env://`` store), in a directory that only
    this user can reach."""
    path = os.environ.get(STORE_FILE)
    if path is None:
        return None
    folder = os.stat(os.path.dirname(os.path.abspath(path)))
    if folder.st_uid != os.getuid() or folder.st_mode & 0o077:
        raise ConfigError(f"{STORE_FILE}: the folder of {path} must be private to this user (mode 0700), "
                          f"not {oct(folder.st_mode & 0o777)}")
    store = dist.FileStore(path, world)
    store.set_timeout(timeout)
    return store


def _bind_gloo_towards(master_addr: str) -> None:
    """Under torchrun, bind gloo's sockets to this machine's interface towards ``MASTER_ADDR`` (unless
    ``GLOO_SOCKET_IFNAME`` says otherwise): left alone, gloo binds the address this machine's hostname resolves to,
    often a loopback one (``127.0.1.1`` in Debian's /etc/hosts), which it then gives the other nodes to connect to.
    """
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    interface = interface_towards(master_addr)
    if interface is None:
        logger.warning(f"Found no network interface of this machine towards MASTER_ADDR {master_addr}: gloo binds "
                       "what this machine's hostname resolves to (set GLOO_SOCKET_IFNAME if the stages cannot meet)")
        return
    logger.info(f"gloo binds interface {interface} (the one towards MASTER_ADDR {master_addr})")
    os.environ["GLOO_SOCKET_IFNAME"] = interface


def interface_towards(address: str) -> str | None:
    """The name of this machine's network interface whose IPv4 address the kernel picks to reach ``address`` (the
    interface holding ``address`` if it is this machine's own); None if there is none (IPv6, no route, not Linux)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # a UDP connect sends nothing: the kernel only chooses the route
            local = probe.getsockname()[0]
    except OSError:
        return None
    return next((name for _index, name in socket.if_nameindex() if _ipv4_address(name) == local), None)


def _ipv4_address(interface: str) -> str | None:
    """The (primary) IPv4 address of ``interface`` (Linux's SIOCGIFADDR); None if it has none."""
    request = struct.pack("256s", interface.encode()[:15])
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            reply = fcntl.ioctl(probe.fileno(), 0x8915, request)  # SIOCGIFADDR
    except OSError:
        return None
    return socket.inet_ntoa(reply[20:24])


def check_one_gpu_per_stage(device: torch.device, spec: str, local_stages: int) -> None:
    """NCCL joins one process per GPU: two stages of a peer on one GPU fail at their first collective with
    ``NCCL error ... invalid usage`` (e.g. --stages 2 on a one-GPU machine). Refuse that up front.

    Raises:
        ConfigError: naming the stages, the GPUs and what to change.
    """
    if device.type != "cuda" or local_stages <= 1:
        return
    gpus = torch.cuda.device_count()
    if spec.startswith("cuda:") or gpus < local_stages:
        raise ConfigError(
            f"run.device: {local_stages} stages of this peer on this machine need one GPU each (NCCL), but "
            + (f"run.device = {spec!r} puts them all on one" if spec.startswith("cuda:") else f"{gpus} visible")
            + "; use run.device 'cuda' on a machine with a GPU per stage, fewer stages, or run.device 'cpu'")


def _stage_device(spec: str, local_rank: int) -> torch.device:
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda":
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device(spec)


def _short(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__
