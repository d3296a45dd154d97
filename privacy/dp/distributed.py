"""Distributed DP-FedAvg on the client: the ``dp-clip`` client mod clips the client's update and adds its share of
the noise before the reply leaves the client, so the server (with secure aggregation, see
:mod:`privacy.secagg`) never holds a noise-free sum.

With m clients expected per round and a tolerated dropout fraction ``d``, each client adds ``N(0, s^2 I)`` with
``s = z C / sqrt(n_min)``, ``n_min = ceil(m (1 - d))`` (:func:`~privacy.dp.mechanism.noise_share_stddev`). The
shares of the ``k`` clients whose updates are summed add up to noise of standard deviation ``z C sqrt(k / n_min)``:

- ``k = n_min``: exactly ``z C``, the central mechanism's noise on the sum;
- ``k > n_min`` (fewer dropouts than tolerated): more noise than needed (up to ``1 / sqrt(1 - d)`` times);
- ``k < n_min``: less noise than accounted; the server refuses to release such a sum
  (:class:`~privacy.dp.aggregator.DPFedAvgAggregator` raises AggregationError and the round fails).

Without ``d`` (``d = 0``) every dropout would lower the noise below ``z C``: a round of ``k = m - 1`` updates would
carry only ``z C sqrt((m - 1) / m)``. The noise comes from the OS's entropy, never from the run's seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from fedcore.errors import ClientTaskError, ConfigError
from fedcore.messages import FitIns, FitRes
from fedcore.mods import CallNext, ModContext
from fedcore.tensors import NamedArrays
from privacy.dp.mechanism import clip_update, gaussian_noise

MOD_NAME = "dp-clip"
"""The client mod's registered name."""


@dataclass(frozen=True, kw_only=True)
class ClipAndNoiseMod:
    """The ``dp-clip`` client mod: after training, the update ``delta = w_k - w`` (the reply's model minus the
    instruction's) is clipped to L2 norm ``clipping_norm`` over its floating tensors and ``N(0, noise_stddev^2)``
    is added to every element; the reply carries ``w + clipped + noise`` in the model's dtypes. Integer tensors are
    sent back as the instruction had them.

    Attributes:
        clipping_norm: C > 0.
        noise_stddev: this client's noise standard deviation s >= 0 (``z C / sqrt(n_min)``; 0 clips only).

    Raises:
        ConfigError: a parameter out of range (when the strategy is configured and when the client receives it).
    """

    clipping_norm: float
    noise_stddev: float

    def __post_init__(self) -> None:
        for name in ("clipping_norm", "noise_stddev"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value!r}")
        if self.clipping_norm <= 0:
            raise ConfigError(f"clipping_norm must be > 0, got {self.clipping_norm!r}")
        if self.noise_stddev < 0:
            raise ConfigError(f"noise_stddev must be >= 0, got {self.noise_stddev!r}")

    def __call__(self, instruction: FitIns, context: ModContext, call_next: CallNext) -> FitRes:
        """Train (``call_next``), then clip the update and add this client's noise share."""
        reply = call_next(instruction)
        if set(reply.parameters) != set(instruction.parameters):
            raise ClientTaskError(
                "dp-clip: the trained model's tensors differ from the global model's; the update cannot be clipped",
                round=instruction.round,
                client_id=context.client_id,
            )
        return replace(reply, parameters=self.privatize(instruction.parameters, reply.parameters))

    def privatize(
        self, reference: NamedArrays, model: NamedArrays, rng: np.random.Generator | None = None
    ) -> NamedArrays:
        """``reference + clip(model - reference, C) + N(0, s^2)`` for the floating tensors, ``reference``'s values
        for the others (``rng``: default a generator seeded from the OS)."""
        floating = [n for n, a in reference.items() if np.asarray(a).dtype.kind == "f"]
        delta = {
            n: np.asarray(model[n], dtype=np.float64) - np.asarray(reference[n], dtype=np.float64) for n in floating
        }
        clipped, _ = clip_update(delta, self.clipping_norm)
        noise = gaussian_noise(
            {n: np.shape(reference[n]) for n in floating},
            self.noise_stddev,
            rng if rng is not None else np.random.default_rng(),
        )
        out: NamedArrays = {}
        for name, ref in reference.items():
            r = np.asarray(ref)
            if name in clipped:
                out[name] = (r.astype(np.float64) + clipped[name] + noise[name]).astype(r.dtype)
            else:
                out[name] = np.array(r, copy=True)
        return out
