"""An α-β planner for data-parallel communication: predicted comm and exposed time, wire bytes and peak
memory per rank for each strategy and bucket size, and a recommended bucket size
(``python -m gradsync.buffers.plan --help``)."""

from .costs import PUBLISHED, LinkCosts
from .predict import STRATEGIES, Prediction, predict, recommend_bucket_size, specs_from_shapes

__all__ = [
    "PUBLISHED",
    "STRATEGIES",
    "LinkCosts",
    "Prediction",
    "predict",
    "recommend_bucket_size",
    "specs_from_shapes",
]
