"""Aggregation: how a round's client updates become one, and the weighted averages of their metrics.

Pure math apart from I/O (STYLE.md §1); strategies and the server call it. One module per part:

- :mod:`~fedcore.aggregation.protocol`: the seam, :class:`Aggregator` (carried by the strategy) and the
  :class:`Accumulator` it starts each round (:class:`SumAccumulator`: one that also takes a batch's weighted sum).
- :mod:`~fedcore.aggregation.streaming`: the streaming weighted mean (:class:`WeightedMean`, FedAvg's rule, the
  default :class:`MeanAggregator`): memory O(model) however many clients report.
- :mod:`~fedcore.aggregation.robust`: coordinate-wise median and trimmed mean, Krum / Multi-Krum (reading whole
  updates block by block from read-only file mappings) and norm bounding (streaming).
- :mod:`~fedcore.aggregation.blocks`: the thread pool and block passes they share, and the checks made before an
  update is kept.
- :mod:`~fedcore.aggregation.metrics`: example-weighted averages of reported metrics.
"""

from fedcore.aggregation.metrics import (
    MetricAverages,
    MetricColumns,
    example_weight,
    metric_value,
    weighted_average,
    weighted_metrics,
)
from fedcore.aggregation.protocol import Accumulator, Aggregator, BlockArray, CountsRejections, SumAccumulator
from fedcore.aggregation.robust import (
    KrumAggregator,
    MedianAggregator,
    NormBoundAggregator,
    SpilledUpdates,
    TrimmedMeanAggregator,
)
from fedcore.aggregation.streaming import MeanAggregator, WeightedMean, mean

__all__ = [
    "Accumulator",
    "Aggregator",
    "BlockArray",
    "CountsRejections",
    "KrumAggregator",
    "MeanAggregator",
    "MedianAggregator",
    "MetricAverages",
    "MetricColumns",
    "NormBoundAggregator",
    "SpilledUpdates",
    "SumAccumulator",
    "TrimmedMeanAggregator",
    "WeightedMean",
    "example_weight",
    "mean",
    "metric_value",
    "weighted_average",
    "weighted_metrics",
]
