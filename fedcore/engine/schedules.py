"""Pipeline schedule rules as pure functions: which rank holds which stage, what a schedule needs, its bubble.

Nothing here touches a process group, so the rules are tested on their own and the plan can be validated
before any worker starts.

Sources: GPipe (Huang et al. 2019) idles a fraction ``(p-1)/(m+p-1)`` of each step with ``p`` stages and
``m`` micro-batches; 1F1B (PipeDream-Flush, Narayanan et al. 2021) has the same bubble but keeps at most ``p``
micro-batches of activations alive, and needs ``m >= p``; interleaved 1F1B (Narayanan et al. 2021, Megatron-LM)
gives each rank ``v`` non-adjacent stages, shrinking the bubble to ``(p-1)/(v*m + p-1)``.
"""

from __future__ import annotations

from enum import StrEnum

from fedcore.errors import ConfigError


class Schedule(StrEnum):
    """Pipeline schedules the engine can run (names as written in TOML / on the CLI)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"


def stages_of_rank(rank: int, pipeline: int, stages_per_rank: int) -> list[int]:
    """Stage indices held by pipeline rank ``rank``: ``rank, rank + p, rank + 2p, ...`` (looped placement).

    With ``stages_per_rank == 1`` this is ``[rank]``. The looped placement is what interleaved 1F1B expects:
    stage ``s`` lives on rank ``s % p``.

    Raises:
        ConfigError: ``rank`` is outside ``[0, pipeline)``.
    """
    if not 0 <= rank < pipeline:
        raise ConfigError(f"pipeline rank {rank} is outside [0, {pipeline})")
    return [rank + k * pipeline for k in range(stages_per_rank)]


def rank_of_stage(stage: int, pipeline: int) -> int:
    """The pipeline rank that holds stage ``stage`` under the looped placement (``stage % pipeline``)."""
    return stage % pipeline


def check_schedule(schedule: Schedule, *, pipeline: int, stages_per_rank: int, microbatches: int) -> None:
    """Raise :class:`ConfigError` unless ``schedule`` can run with these degrees.

    Rules:
        - GPipe and 1F1B hold one stage per rank (``stages_per_rank == 1``).
        - 1F1B needs ``microbatches >= pipeline`` (it keeps ``p`` micro-batches in flight in its warm-up).
        - Interleaved 1F1B needs ``stages_per_rank >= 2``, ``microbatches >= pipeline`` and ``microbatches``
          a multiple of ``pipeline`` (micro-batches run in rounds of ``p``).
    """
    if schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B) and stages_per_rank != 1:
        raise ConfigError(
            f"schedule {schedule.value!r} runs one stage per rank, but stages_per_rank={stages_per_rank}; "
            f"use schedule='{Schedule.INTERLEAVED_1F1B.value}' for several stages per rank"
        )
    if schedule is Schedule.ONE_F_ONE_B and microbatches < pipeline:
        raise ConfigError(
            f"1F1B needs at least as many micro-batches as stages: microbatches={microbatches} < "
            f"{pipeline} stages; raise microbatches or use schedule='gpipe'"
        )
    if schedule is Schedule.INTERLEAVED_1F1B:
        if stages_per_rank < 2:
            raise ConfigError(
                "interleaved 1F1B needs stages_per_rank >= 2 (several stages per rank); "
                "with one stage per rank use schedule='1f1b'"
            )
        if microbatches < pipeline or microbatches % pipeline:
            raise ConfigError(
                f"interleaved 1F1B needs microbatches to be a positive multiple of the pipeline degree "
                f"{pipeline}, got {microbatches}"
            )


def bubble_fraction(stages: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Ideal idle fraction of a pipeline step: ``(p-1) / (v*m + p-1)``.

    Args:
        stages: pipeline ranks ``p`` (>= 1).
        microbatches: micro-batches per step ``m`` (>= 1).
        stages_per_rank: virtual stages per rank ``v`` (1 for GPipe / 1F1B).

    Returns:
        A fraction in ``[0, 1)``; 0 for a single stage. Assumes uniform stages and free communication.
    """
    if stages < 1 or microbatches < 1 or stages_per_rank < 1:
        raise ConfigError(f"stages, microbatches and stages_per_rank must be >= 1, got {stages}, {microbatches}")
    return (stages - 1) / (stages_per_rank * microbatches + stages - 1)


def one_f_one_b_order(rank: int, pipeline: int, microbatches: int) -> list[tuple[str, int]]:
    """The 1F1B compute order of one rank as ``[("F", mb), ("B", mb), ...]``.

    Warm-up runs ``min(p - rank - 1, m)`` forwards, the steady state alternates one forward and one backward,
    the cool-down drains the remaining backwards. Useful for reasoning about memory: the number of forwards
    without their backward never exceeds ``p - rank``.
    """
    warmup = min(pipeline - rank - 1, microbatches)
    order: list[tuple[str, int]] = [("F", mb) for mb in range(warmup)]
    next_forward, next_backward = warmup, 0
    while next_forward < microbatches:
        order.append(("F", next_forward))
        next_forward += 1
        order.append(("B", next_backward))
        next_backward += 1
    order.extend(("B", mb) for mb in range(next_backward, microbatches))
    return order


def peak_in_flight(order: list[tuple[str, int]]) -> int:
    """Largest number of micro-batches whose forward ran but whose backward has not, over ``order``."""
    alive, peak = 0, 0
    for kind, _ in order:
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
    return peak
