"""Trajectory data as the trainer sees it: padded batches and their unpadded rows."""

from offbeat.core.data.batch import Trajectory, TrajectoryBatch

__all__ = ["Trajectory", "TrajectoryBatch"]
