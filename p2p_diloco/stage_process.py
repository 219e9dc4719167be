"""Building and running one stage process of a peer from a :class:`Config`.

:func:`run_stage` is the whole life of a stage process: data, model slice, DHT node, config check against
the swarm, averager, stage state, executor, trainer, and a shutdown that always runs. With P = 1 a peer is
one such process holding the whole model; with P > 1 each of its P processes runs this with its
:class:`~p2p_diloco.pipeline.PipelineContext`. Called by the ``peer`` command.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Optional

import torch

from p2p_diloco.config import AveragingConfig, Config, ConfigError, DHTConfig
from p2p_diloco.data import WindowSampler, eval_batches, read_meta, resolve_data_path, seed_from_peer_id
from p2p_diloco.memory import (
    RunShape,
    available_host_memory,
    describe,
    env_local_processes,
    fit_advice,
    format_gb,
    peer_memory,
    shortfall,
)
from p2p_diloco.model import ModelArgs, build_stage_model, model_args_from_config
from p2p_diloco.model.fragments import fragment_parts
from p2p_diloco.model.hf_folder import HFFolder, load_stage
from p2p_diloco.model.init_from import check_tokenizer, init_digest
from p2p_diloco.model.split import stage_shapes
from p2p_diloco.pipeline.launch import LAUNCHED_BY_US
from p2p_diloco.pipeline.replicas import ReplicaBatches, ReplicaLeader
from p2p_diloco.round.stage import Stage
from p2p_diloco.stage_setup import (
    check_vocab,
    load_data,
    make_executor,
    max_seq_len,
    resolve_init,
    resolve_split,
    stage_units,
)
from p2p_diloco.training.ledger import Held
from p2p_diloco.training.summary import Reporter, TrainSummary
from p2p_diloco.training.sync import SwarmSync
from p2p_diloco.training.trainer import Trainer
from p2p_diloco.training.witnesses import bootstrap_peer_ids

logger = logging.getLogger(__name__)


def donor_wait_s(averaging: AveragingConfig) -> float:
    """How long a donor waits for its round in flight before serving its state (see :func:`_serve_state`). It
    stays well inside the newcomer's wait for the first chunk from each donor (hivemind's next_chunk_timeout),
    or the newcomer gives up on every donor while they wait (a restarted peer then cannot reload)."""
    return min(10.0, averaging.allreduce_timeout_s, 0.5 * averaging.next_chunk_timeout_s)


def _serve_state(stage: Stage, averager, run_id: str, wait_s: float):
    """What a newcomer downloads from this stage (runs in a background thread of this process). The average of
    the round in flight is waited for a little first: a state *after* it lets the newcomer hold the others'
    anchor from its first round on, where one before it would leave the newcomer a round short."""
    deadline = time.monotonic() + wait_s
    while True:
        averager.wait_for_round(max(0.0, deadline - time.monotonic()))
        with stage.state_lock:  # no round end in between: the buffers still hold the average of that round
            if averager.round_settled or time.monotonic() >= deadline:  # (or a round end started another)
                finished = averager.finished_average() or ()  # (average, group size) of the round in flight
                return stage.shareable_state(run_id, *finished)


def select_device(spec: str) -> torch.device:
    """The training device: 'auto' picks CUDA when present."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"run.device: {spec!r} was asked for but CUDA is not available on this machine")
    return device


def check_init_from(cfg: Config) -> None:
    """What a pipelined peer checks of ``model.init_from`` before it starts its stage processes: the folder, its
    shape against the config and the split, its tokenizer against the data's; and the weights digest, computed
    once here for its stages (:func:`init_digest` caches it in the output folder)."""
    folder, args = resolve_init(cfg)
    resolve_split(cfg, args, fragment_parts(args, cfg.diloco.fragments) if cfg.diloco.fragments else None)
    data_path = resolve_data_path(cfg.data)
    check_tokenizer(folder, data_path, read_meta(data_path)["tokenizer"])
    init_digest(folder, Path(cfg.run.output_dir))


def run_shape(cfg: Config, seq_len: int, device_type: str) -> RunShape:
    """The run's settings that the memory estimate needs."""
    return RunShape(cfg.data.batch_size, seq_len, cfg.pipeline.microbatches, cfg.pipeline.schedule, cfg.diloco.mode,
                    cfg.averaging.compression != "none", "cuda" if device_type == "cuda" else "cpu")


def check_memory(cfg: Config, model_args: ModelArgs, split: list[int], stage_index: int, device: torch.device,
                 seq_len: int) -> None:
    """Stop with one line naming what to change if the processes of this peer on this machine need more memory than
    it has available (or this stage more than its device has free); :mod:`p2p_diloco.memory` makes the estimate.
    Our launcher runs every stage here; under torchrun, LOCAL_WORLD_SIZE stages share the machine.

    Raises:
        ConfigError: naming ``run.check_memory`` and what to change.
    """
    memory = peer_memory(stage_shapes(model_args, split), run_shape(cfg, seq_len, device.type),
                         replicas=cfg.pipeline.replicas)
    if len(split) == 1 or os.environ.get(LAUNCHED_BY_US) == "1":
        local = list(range(len(split)))
    else:  # torchrun: this node's share of the stages, as many of the largest as it runs
        largest = sorted(range(len(split)), key=memory.stage_host, reverse=True)
        local = largest[:min(len(split), env_local_processes())]
    need = sum(memory.stage_host(j) for j in local)
    available = available_host_memory()
    where = "this peer" if len(local) == len(split) else f"{len(local)} stage(s) of this peer on this machine"
    if shortfall(need, available):
        raise ConfigError(f"run.check_memory: {where} needs about {format_gb(need)} of memory "
                          f"({describe(memory, local)} GB) and this machine has {format_gb(available)} available; "
                          f"{fit_advice(len(split), device.type)}")
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        need_device = memory.stage_device(stage_index)
        if need_device > free:
            raise ConfigError(f"run.check_memory: stage {stage_index} needs about {format_gb(need_device)} on "
                              f"{device} and it has {format_gb(free)} free; {fit_advice(len(split), 'cuda')}")
    logger.info(f"Memory: {where} needs about {format_gb(need)} ({describe(memory, local)} GB); "
                f"{format_gb(available) if available is not None else 'unknown'} available")


def build_model(model_args: ModelArgs, split: list[int], stage_index: int, folder: Optional[HFFolder]):
    """This stage's model: initialized from ``model.init_seed``, or loaded from the ``model.init_from`` folder (only
    this stage's tensors are read)."""
    model = build_stage_model(model_args, split, stage_index, initialize=folder is None)
    if folder is not None:
        load_stage(folder, model)
    return model


def stage_dht_config(cfg: DHTConfig, stage_index: int, num_stages: int) -> DHTConfig:
    """Stage j of a P-stage peer runs its own DHT node: its own identity file and, for fixed ports, port + j."""
    if num_stages == 1:
        return cfg

    def shift(maddr: str) -> str:
        return re.sub(r"/(tcp|udp)/(\d+)", lambda m: f"/{m[1]}/{int(m[2]) + stage_index if int(m[2]) else 0}",
                      maddr)

    return dataclasses.replace(
        cfg, host_maddrs=[shift(m) for m in cfg.host_maddrs], announce_maddrs=[shift(m) for m in cfg.announce_maddrs],
        identity_path=f"{cfg.identity_path}.stage{stage_index}" if cfg.identity_path else None,
    )


@dataclass(frozen=True)
class SwarmClasses:
    """What :func:`run_stage` builds a unit's averager and swarm link with; None: the swarm package's
    ``PseudoGradientAverager`` and ``SwarmLink``. A seam: a test's hostile peer (``python -m tests.hostile.peer``)
    sets :data:`SWARM_CLASSES` to subclasses that lie before it runs the ``peer`` command in its one process."""

    averager: Optional[Callable] = None  # called as PseudoGradientAverager is
    link: Optional[Callable] = None  # called as SwarmLink is


SWARM_CLASSES = SwarmClasses()


def run_stage(cfg: Config, *, pipeline=None, reporter: Optional[Reporter] = None,
              on_trainer: Optional[Callable[[Trainer], None]] = None, dht=None) -> TrainSummary:
    """Run one stage process to the end of training (or until its trainer is asked to stop).

    Args:
        cfg: validated config.
        pipeline: this process's :class:`PipelineContext` when the peer has P > 1 stages, else None.
        reporter: console progress.
        on_trainer: called with the trainer before training starts (signal handlers hook in here).
        dht: a running DHT to use instead of starting one (it is not shut down here).
    """
    from p2p_diloco.monitoring import serve_stage_metrics
    from p2p_diloco.swarm import PseudoGradientAverager, SwarmLink, start_dht, visible_maddrs
    from p2p_diloco.swarm.discovery.fingerprint import check_fingerprint, config_fingerprint
    from p2p_diloco.swarm.discovery.reachability import check_reachable
    from p2p_diloco.swarm.discovery.records import swarm_validators

    stage_index = pipeline.stage_index if pipeline is not None else 0
    device = pipeline.device if pipeline is not None else select_device(cfg.run.device)
    output_dir = Path(cfg.run.output_dir)
    folder, init_args = resolve_init(cfg) if cfg.model.init_from is not None else (None, None)
    data = load_data(cfg, max_seq_len=init_args.max_seq_len if init_args else max_seq_len(cfg))
    model_args = init_args or model_args_from_config(cfg.model, data.train.vocab_size)
    check_vocab(data, model_args.vocab_size)
    parts = fragment_parts(model_args, cfg.diloco.fragments) if cfg.diloco.fragments else None
    split = resolve_split(cfg, model_args, parts)
    if folder is not None:
        check_tokenizer(folder, data.train.path, data.train.tokenizer_name)
    if cfg.run.check_memory:  # before anything is built: a peer that cannot fit says so, not the kernel mid-round
        check_memory(cfg, model_args, split, stage_index, device, data.seq_len)
    # the names and shapes of this stage's parameters, with no memory: the DHT node's and the averagers' processes
    # are forked from this one before the weights exist, so none of them holds a stale copy of them (docs/design.md,
    # "What a peer holds")
    skeleton = build_stage_model(model_args, split, stage_index, initialize=False, device="meta")
    digest = init_digest(folder, output_dir) if folder is not None else None
    fingerprint = config_fingerprint(model_args, split, data.train.meta, cfg.diloco.fragments, init_digest=digest)
    output_dir.mkdir(parents=True, exist_ok=True)

    own_dht = dht is None
    dht_cfg = stage_dht_config(cfg.dht, stage_index, len(split))
    if own_dht:
        dht = start_dht(dht_cfg, record_validators=swarm_validators(cfg.run.run_id, len(split), cfg.diloco.fragments))
    held, trainer, metrics_server, averagers = [], None, None, []
    try:
        logger.info(f"Stage {stage_index}: DHT node up; others can join through: {' '.join(visible_maddrs(dht))}")
        if own_dht:  # a peer nobody can dial is told what to set now, not by rounds that time out
            check_reachable(dht, dht_cfg, sorted(bootstrap_peer_ids(dht_cfg.initial_peers)))
        check_fingerprint(dht, cfg.run.run_id, fingerprint, allowlist=frozenset(cfg.averaging.allowlist))
        own_name = dht.peer_id.to_base58()
        peer_name = pipeline.broadcast_object(own_name) if pipeline is not None else own_name
        for fragment, _, params in stage_units(skeleton, parts):  # (their processes fork here: before the weights)
            averagers.append((SWARM_CLASSES.averager or PseudoGradientAverager)(
                [p for _, p in params], dht, run_id=cfg.run.run_id, stage_index=stage_index, num_stages=len(split),
                cfg=cfg.averaging, fragment=fragment))
        model = build_model(model_args, split, stage_index, folder).to(device)
        units = stage_units(model, parts)
        total_steps = cfg.inner.total_steps or cfg.train.num_rounds * cfg.diloco.inner_steps
        seed = cfg.data.seed if cfg.data.seed is not None else seed_from_peer_id(peer_name)
        sampler = WindowSampler(data.train, data.seq_len, cfg.data.batch_size * cfg.pipeline.replicas, seed)
        if cfg.pipeline.replicas > 1:  # replica 0's share of the batches the peer's D replicas draw together
            sampler = ReplicaBatches(sampler, cfg.pipeline.replicas, 0)
        eval_data = eval_batches(data.eval, data.seq_len, cfg.data.batch_size, cfg.data.eval_batches) \
            if data.eval is not None else []
        executor = make_executor(cfg, pipeline, model, device)
        for (fragment, module, _), averager in zip(units, list(averagers)):
            link_type = SWARM_CLASSES.link or SwarmLink
            swarm = link_type(dht, cfg.run.run_id, peer_name, stage_index=stage_index, num_stages=len(split),
                              inner_steps=cfg.diloco.inner_steps, fingerprint=fingerprint,
                              joined_swarm=bool(cfg.dht.initial_peers), num_rounds=cfg.train.num_rounds,
                              fragment=fragment, allowlist=cfg.averaging.allowlist,
                              stranger_wait_s=cfg.averaging.matchmaking_time_s + cfg.averaging.request_timeout_s)
            # a round nobody can join any more (the records say so) fails at once, not after its timeout
            stage = Stage(module, stage_index=stage_index, num_stages=len(split), inner_cfg=cfg.inner,
                          diloco_cfg=cfg.diloco, total_steps=total_steps, averager=averager, fragment=fragment,
                          records=swarm)
            held.append(Held(stage))
            averagers.remove(averager)  # the stage shuts it down
            averager.state_provider = partial(_serve_state, stage, averager, cfg.run.run_id,
                                              wait_s=donor_wait_s(cfg.averaging))
            sync = SwarmSync(stage, swarm, executor, cfg.run.run_id, download_timeout_s=cfg.train.state_timeout_s,
                             num_rounds=cfg.train.num_rounds, allowlist=cfg.averaging.allowlist,
                             bootstrap=bootstrap_peer_ids(cfg.dht.initial_peers),
                             end_wait_s=cfg.averaging.round_timeout_s + cfg.averaging.allreduce_timeout_s)
            held[-1].swarm, held[-1].sync = swarm, sync
        if pipeline is not None and pipeline.num_replicas > 1:  # replica 0 leads this stage's other replicas
            executor.replicas = ReplicaLeader(pipeline, [(u.stage.params, u.stage.inner_optimizer) for u in held],
                                              sampler)
        first = held[0]
        trainer = Trainer(cfg, first.stage, executor, sampler, eval_data, swarm=first.swarm, output_dir=output_dir,
                          peer_name=peer_name, reporter=reporter, sync=first.sync, held=held)
        if on_trainer is not None:
            on_trainer(trainer)
        metrics_server = serve_stage_metrics(cfg.metrics, trainer, dht, cfg.run.run_id, peer_name)
        return trainer.run()
    finally:
        if metrics_server is not None:
            metrics_server.close()
        if trainer is not None:  # the run closes its metrics; a start that failed before it must too (W&B, TB)
            trainer.metrics.close()
        for unit in held:
            unit.stage.shutdown()
        for averager in averagers:  # started, but the start failed before a stage took it
            averager.shutdown()
        if own_dht:
            dht.shutdown()

