"""Student training from a top-K cache: `train(TrainConfig(...))`, or `topkd train`."""

from topkd.train.config import TrainConfig
from topkd.train.loop import train

__all__ = ["TrainConfig", "train"]
