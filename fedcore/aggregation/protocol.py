"""The Aggregator seam: how a round's updates become one (DESIGN.md, "Round protocol seams").

The strategy carries an :class:`Aggregator`; for each round the round loop checks that the rule fits the number
of selected clients (:meth:`Aggregator.check`, before any client is contacted), starts an :class:`Accumulator`
and adds every update to it as it arrives, then takes the result once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from fedcore.tensors import NamedArrays, TensorSpec


@runtime_checkable
class BlockArray(Protocol):
    """A tensor of an update that is produced block by block as it is read, never whole: a compressed update
    decoded on the fly (:class:`fedcore.compression.DecodedTensor`). The streaming mean reads it in blocks; any other
    reader gets the whole tensor through ``np.asarray``.
    """

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape."""
        ...

    @property
    def dtype(self) -> np.dtype:
        """The tensor's dtype."""
        ...

    def read(self, start: int, stop: int) -> np.ndarray:
        """The flattened elements ``[start, stop)``, a new 1-D array of :attr:`dtype`."""
        ...

    def __getitem__(self, key: slice) -> np.ndarray:
        """``read`` of a slice (step 1) over the flattened tensor."""
        ...


@runtime_checkable
class Accumulator(Protocol):
    """One round's aggregation in progress: updates are added as they arrive, the result is taken once.

    :class:`~fedcore.aggregation.WeightedMean` is the default one. An implementation validates an update completely
    before it keeps anything of it, so a rejected update (the exceptions below) leaves the round's aggregate untouched.
    """

    @property
    def count(self) -> int:
        """Number of updates accepted so far."""
        ...

    def add(
        self, update: Mapping[str, np.ndarray], weight: float, *, client_id: str | None = None, round: int | None = None
    ) -> None:
        """Validate and take in one client's update (``name -> array`` matching the round's spec) with its
        aggregation weight (finite, >= 0).

        Raises:
            UpdateRejected, PayloadError, NonFiniteError: the update or its weight cannot be used.
        """
        ...

    def result(self, *, release: bool = False) -> NamedArrays:
        """The aggregate, with the spec's names, shapes and dtypes. ``release=True`` may reuse the accumulator's
        memory for the result, after which the accumulator is spent.

        Raises:
            AggregationError: nothing usable was added (no updates, weights summing to 0, too few for the rule).
        """
        ...


@runtime_checkable
class CountsRejections(Protocol):
    """An :class:`Accumulator` of a rule that tolerates ``f`` Byzantine clients and is told of the updates the round
    loop refused (not finite, the wrong names, shapes or dtypes, a bad weight or example count, undecodable).

    A client whose update was refused is faulty, so it is one of the ``f`` the rule tolerates: the kept updates
    hold at most ``f - r`` Byzantine ones after ``r`` distinct clients were refused, and the rule is applied for
    that many (Blanchard et al. 2017 and Yin et al. 2018 count any deviation from the protocol as Byzantine).
    Without this, ``f`` clients that sent NaN left too few updates for a rule sized for ``f`` and failed the round.
    A client that failed to reply is not counted: it may be honest and merely slow.
    """

    def rejected(self, client_id: str) -> None:
        """Record that ``client_id``'s update was refused (each client counts once)."""
        ...


@runtime_checkable
class SumAccumulator(Accumulator, Protocol):
    """An :class:`Accumulator` that also takes several clients' updates already combined into their weighted sum
    (:class:`~fedcore.messages.FitBatchRes`, from a pool that trains clients together). Only a rule that is linear
    in the updates can: the weighted mean (:class:`~fedcore.aggregation.WeightedMean`). Robust rules, clipping and
    secure aggregation need each update on its own, and the round loop refuses a batch for them.
    """

    def add_sum(
        self,
        weighted_sum: Mapping[str, np.ndarray],
        weights: Sequence[float],
        *,
        client_ids: Sequence[str] | None = None,
        round: int | None = None,
    ) -> None:
        """Validate and take in ``Σ_k weights[k] · update_k`` (``name -> float64 array`` of the spec's shapes) as
        if each update had been added with its weight.

        Raises:
            UpdateRejected, PayloadError, NonFiniteError: the sum or a weight cannot be used; nothing is kept.
        """
        ...


@runtime_checkable
class Aggregator(Protocol):
    """How a round's updates become one: the strategy carries it and the round loop folds every update through
    the :class:`Accumulator` it starts for the round (DESIGN.md, "Round protocol seams").

    Implementations: :class:`~fedcore.aggregation.MeanAggregator` (the default streaming weighted mean) and the
    robust rules of :mod:`fedcore.aggregation.robust`; :func:`fedcore.strategy.build_aggregator` builds one
    from a recipe's ``[strategy]`` table.
    """

    @property
    def name(self) -> str:
        """A label for reports and configuration (e.g. ``"mean"``)."""
        ...

    def start(
        self, spec: Sequence[TensorSpec], *, round: int, reference: Mapping[str, np.ndarray] | None = None
    ) -> Accumulator:
        """A fresh accumulator for one round over tensors of ``spec``.

        Args:
            spec: names, shapes and dtypes every update must match (the global model's).
            round: the round, for error messages.
            reference: the global model the round's clients started from (``name -> array`` of ``spec``), for
                rules that look at each update's difference from it (norm bounding); others ignore it. The
                accumulator only reads it and keeps it until its result is taken.

        Raises:
            ConfigError: the spec cannot be aggregated by this rule, or the rule needs a reference and got none.
        """
        ...

    def check(self, num_clients: int) -> None:
        """Refuse, before any client is contacted, a round of ``num_clients`` selected clients that this rule
        cannot aggregate (e.g. Krum with too few clients for the Byzantine clients it must tolerate).

        Raises:
            ConfigError: what does not fit and what to change.
        """
        ...
