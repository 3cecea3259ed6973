"""Training: multi-group gradient reduction, training loop."""

from .ddp import GradBucket, MultiGroupDistributedDataParallel, ParamFamily

__all__ = ["GradBucket", "MultiGroupDistributedDataParallel", "ParamFamily"]
