"""Byzantine clients for simulations: a configurable fraction of the virtual clients attacks every round.

The ``[attack]`` table of a recipe (:class:`AttackConfig`) names the attack and the fraction of attackers; which
clients attack is drawn once from the run's seed (:func:`choose_attackers`), so a recipe always has the same
attackers. Model-poisoning attacks rewrite an attacker's reply on its way to the server (:class:`AttackedPool`,
a wrapper of any client pool); data poisoning (label flipping) trains the attacker on altered data
(:func:`attacked_tasks`). The attacks, with ``Δ = u - g`` the honest update's difference from the global model
``g``:

=============  ===================================================================================================
sign_flip      sends ``g - s·Δ`` (s = ``scale``, default 1): the negated update (Damaskinos et al. 2018; Li et
               al. 2019, RSA, with s = 4)
scale          sends ``g + s·Δ`` (default s = 10): a boosted update (Bhagoji et al. 2019)
gaussian       sends ``g + N(0, σ²)`` per element (σ = ``noise_std``): a random update (Blanchard et al. 2017)
label_flip     trains on labels ``y -> C - 1 - y`` of its own data (Fang et al. 2020; Tolpegin et al. 2020)
label_noise    trains on noisy labels: each of its training labels is replaced, with probability ``noise_rate``, by
               a class drawn uniformly from all C (symmetric label noise, Natarajan et al. 2013); drawn once per
               client from (seed, client). Not an attack so much as a low-quality client (quality weighting's case)
=============  ===================================================================================================

Only floating tensors are changed; integer buffers (BatchNorm's counters) pass through. A reply's tensor groups
(SCAFFOLD's control variates' ``delta c_i``) are differences already: an attacker sends ``-s·delta``, ``s·delta``
or ``N(0, σ²)`` for them (the same attacks around 0), from its own draw of the noise.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedcore.errors import ConfigError
from fedcore.messages import FitBatchRes, FitIns, FitRes, PoolReply, ServerMessage
from fedcore.seeding import numpy_rng
from fedcore.supervised import SupervisedTask
from fedcore.task import Task
from fedcore.tensors import NamedArrays
from server.pool import ClientPool, PoolWrapper

log = logging.getLogger("fedcore.simulation")

ATTACK_NAMES = ("none", "sign_flip", "scale", "gaussian", "label_flip", "label_noise")
LABEL_ATTACKS = ("label_flip", "label_noise")
"""The attacks that alter an attacker's training labels (they need the number of classes)."""
REWRITE_ATTACKS = ("sign_flip", "scale", "gaussian")
"""The model-poisoning attacks: they rewrite an attacker's update on its way to the server (:class:`AttackedPool`)."""
_DEFAULT_SCALE = {"sign_flip": 1.0, "scale": 10.0}


@dataclass(frozen=True, kw_only=True)
class AttackConfig:
    """The ``[attack]`` table of a recipe: which attack, by what fraction of the clients.

    Attributes:
        kind: none, sign_flip, scale, gaussian, label_flip or label_noise (see the module docstring).
        fraction: the fraction of the virtual clients that attack, in [0, 1); ``round(fraction * clients)`` of
            them, drawn from the run's seed.
        scale: ``s`` of sign_flip (default 1) and scale (default 10); finite, > 0.
        noise_std: ``σ`` of gaussian, finite, > 0.
        noise_rate: the probability that label_noise replaces a training label by a random class, in (0, 1].

        An attack's parameters are ignored by the other kinds, so that one recipe can be rerun without its attack
        (``--set attack.kind="none" --set attack.fraction=0``).
    """

    kind: str = "none"
    fraction: float = 0.0
    scale: float | None = None
    noise_std: float = 1.0
    noise_rate: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ATTACK_NAMES:
            raise ConfigError(f"unknown attack {self.kind!r}; choose one of {', '.join(ATTACK_NAMES)}")
        if not 0 <= self.fraction < 1:
            raise ConfigError(f"attack.fraction (of clients that attack) must be in [0, 1), got {self.fraction}")
        if self.kind == "none" and self.fraction != 0:
            raise ConfigError("attack.fraction is set but attack.kind is 'none'; name the attack")
        if self.scale is not None and not 0 < self.scale < math.inf:
            raise ConfigError(f"attack.scale must be a finite number > 0, got {self.scale}")
        if not 0 < self.noise_std < math.inf:
            raise ConfigError(f"attack.noise_std must be a finite number > 0, got {self.noise_std}")
        if not 0 < self.noise_rate <= 1:
            raise ConfigError(f"attack.noise_rate must be in (0, 1], got {self.noise_rate}")

    @property
    def factor(self) -> float:
        """The scale ``s`` in effect (the kind's default when unset)."""
        return self.scale if self.scale is not None else _DEFAULT_SCALE.get(self.kind, 1.0)


def choose_attackers(client_ids: Sequence[str], config: AttackConfig, *, seed: int) -> frozenset[str]:
    """The ``round(fraction * len(client_ids))`` attacking clients, drawn from ``seed`` (the same set for the
    same ids and seed, whatever their order)."""
    if config.kind == "none":
        return frozenset()
    pool = sorted(client_ids)
    count = round(config.fraction * len(pool))
    chosen = numpy_rng(seed, "attackers").choice(len(pool), size=count, replace=False)
    return frozenset(pool[int(i)] for i in chosen)


def poison_update(
    update: Mapping[str, np.ndarray],
    global_model: Mapping[str, np.ndarray],
    config: AttackConfig,
    rng: np.random.Generator,
) -> NamedArrays:
    """The update an attacker sends instead of ``update`` (sign_flip, scale or gaussian; see the module docstring).

    Floating tensors are computed in float64 and cast back to their dtype (a value past its range becomes +-inf, as
    an attacker may send); other tensors are returned as they are.

    Raises:
        ConfigError: ``config.kind`` is not a model-poisoning attack.
    """
    if config.kind not in ("sign_flip", "scale", "gaussian"):
        raise ConfigError(f"{config.kind!r} does not rewrite updates")
    out: NamedArrays = {}
    for name, value in update.items():
        if value.dtype.kind != "f":
            out[name] = value
            continue
        g = np.asarray(global_model[name], np.float64)
        if config.kind == "gaussian":
            poisoned = g + rng.normal(0.0, config.noise_std, size=value.shape)
        else:
            sign = -1.0 if config.kind == "sign_flip" else 1.0
            poisoned = g + sign * config.factor * (np.asarray(value, np.float64) - g)
        with np.errstate(over="ignore"):  # a scaled update past the dtype's range is inf: the attack the run sees
            out[name] = poisoned.astype(value.dtype)
    return out


class AttackedPool(PoolWrapper):
    """A :class:`~server.pool.ClientPool` whose attacking clients' fit replies are poisoned on the way back.

    Args:
        pool: the honest pool (in-memory, or any other).
        attackers: the attacking client ids.
        config: the attack (model-poisoning kinds rewrite replies; others pass them through).
        seed: the run's seed; Gaussian noise is drawn from (seed, "attack", round, client).
    """

    def __init__(self, pool: ClientPool, attackers: frozenset[str], config: AttackConfig, *, seed: int) -> None:
        super().__init__(pool)
        self._attackers = attackers
        self._config = config
        self._seed = seed

    def run(self, instructions: Mapping[str, ServerMessage], *, timeout_s: float | None) -> Iterator[PoolReply]:
        """The honest pool's replies, an attacker's fit result replaced by its poisoned update.

        Raises:
            ConfigError: a model-poisoning attacker's update came already summed into a batch
                (:class:`~fedcore.messages.FitBatchRes`), where it cannot be rewritten; such a run must train without
                pre-summing (:func:`simulations.batched.presum_weight`'s caller leaves it off).
        """
        rewrites = self._config.kind in REWRITE_ATTACKS
        for reply in self._pool.run(instructions, timeout_s=timeout_s):
            if isinstance(reply, FitBatchRes):
                if rewrites and (hidden := [cid for cid in reply.client_ids if cid in self._attackers]):
                    raise ConfigError(
                        f"round {reply.round}: the update of attacker {hidden[0]!r} came summed into a batch, where "
                        f"the {self._config.kind} attack cannot rewrite it; run the batched clients without pre-summing"
                    )
                yield reply
                continue
            instruction = instructions.get(reply.client_id)
            attacker = isinstance(reply, FitRes) and reply.client_id in self._attackers
            if rewrites and attacker and isinstance(reply, FitRes) and isinstance(instruction, FitIns):
                rng = numpy_rng(self._seed, "attack", reply.round, reply.client_id)
                poisoned = poison_update(reply.parameters, instruction.parameters, self._config, rng)
                groups = {
                    name: poison_update(group, _zeros(group), self._config, rng) for name, group in reply.groups.items()
                }
                reply = dataclasses.replace(reply, parameters=poisoned, groups=groups)
                del poisoned
            yield reply
            del reply  # not kept while the next client trains (a model-sized update)


def _zeros(group: Mapping[str, np.ndarray]) -> NamedArrays:
    """Zeros of a tensor group's shapes: the reference its differences are poisoned around."""
    return {name: np.zeros(np.shape(value)) for name, value in group.items()}


def num_classes(task: Task) -> int:
    """The number of classes of a :class:`~fedcore.supervised.SupervisedTask` (largest label in its test or
    training data, plus one).

    Raises:
        ConfigError: the task is not a SupervisedTask with labelled data.
    """
    data = getattr(task, "test_data", None) or getattr(task, "train_data", None)
    if not isinstance(task, SupervisedTask) or data is None:
        raise ConfigError("label flipping needs supervised tasks (SupervisedTask) with labelled data")
    return int(data[1].max()) + 1


def noisy_labels(y: torch.Tensor, classes: int, rate: float, rng: np.random.Generator) -> torch.Tensor:
    """``y`` with each label replaced, with probability ``rate``, by a class drawn uniformly from ``0..classes-1``
    (which may be the label itself): symmetric label noise. ``y``: int64 labels, shape ``(N,)``; a new tensor."""
    replace = rng.random(len(y)) < rate
    random = rng.integers(0, classes, size=len(y))
    return torch.from_numpy(np.where(replace, random, y.cpu().numpy()).astype(np.int64)).to(y.device)


def attacked_tasks(
    make_task: Callable[[str], Task], attackers: frozenset[str], config: AttackConfig, classes: int, *, seed: int = 0
) -> Callable[[str], Task]:
    """``make_task``, with every attacker's task training on altered labels: flipped ``y -> classes - 1 - y``
    (label_flip), or noisy (label_noise, :func:`noisy_labels` drawn from (seed, "label_noise", client)); for other
    attacks ``make_task`` itself.

    Raises:
        ConfigError: (from the returned function) an attacker's task is not a SupervisedTask with training data.
    """
    if config.kind not in LABEL_ATTACKS or not attackers:
        return make_task

    def make(client_id: str) -> Task:
        task = make_task(client_id)
        if client_id not in attackers:
            return task
        if not isinstance(task, SupervisedTask) or task.train_data is None:
            raise ConfigError(
                f"label flipping needs a SupervisedTask with training data; client {client_id!r} has none"
            )
        x, y = task.train_data
        if config.kind == "label_noise":
            rng = numpy_rng(seed, "label_noise", client_id)
            return dataclasses.replace(task, train_data=(x, noisy_labels(y, classes, config.noise_rate, rng)))
        return dataclasses.replace(task, train_data=(x, torch.as_tensor(classes - 1) - y))

    return make
