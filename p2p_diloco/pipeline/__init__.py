"""Pipeline parallelism inside a peer: P stage processes joined by torch.distributed (gloo on CPU, NCCL on
CUDA), running ``torch.distributed.pipelining`` schedules (GPipe, 1F1B). Between peers, each stage averages
only with the same stage of other peers, through hivemind."""

from p2p_diloco.pipeline.context import PipelineContext, PipelineError, launched_as_stage

__all__ = ["PipelineContext", "PipelineError", "launched_as_stage"]
