"""ParallelPlan validation, loading, model checks and schedule rules: no process group needed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fedcore.engine import ParallelPlan, Schedule, bubble_fraction
from fedcore.engine.layers import model_layers, split_stages
from fedcore.engine.schedules import (
    check_schedule,
    one_f_one_b_order,
    peak_in_flight,
    rank_of_stage,
    stages_of_rank,
)
from fedcore.errors import ConfigError
from tests.engine.engine_tasks import deep_mlp, mlp, reused_mlp


def test_default_plan_is_single_process() -> None:
    plan = ParallelPlan()
    assert plan.is_single_process and plan.total_ranks == 1 and plan.num_stages == 1
    assert not (plan.dp_enabled or plan.pp_enabled or plan.fsdp_enabled)


def test_degrees_and_derived_properties() -> None:
    plan = ParallelPlan(
        data_parallel=2,
        pipeline=2,
        split_points=("2",),
        microbatches=4,
        schedule="1f1b",  # type: ignore[arg-type]  # deliberate: a name, coerced to the Schedule
    )
    assert plan.total_ranks == 4 and plan.dp_enabled and plan.pp_enabled and not plan.fsdp_enabled
    assert plan.schedule is Schedule.ONE_F_ONE_B


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pipeline": 2, "split_points": ("2",), "microbatches": 1, "schedule": "1f1b"}, "1F1B needs at least"),
        ({"data_parallel": 2, "pipeline": 2, "split_points": ("2",), "world_size": 8}, "multiply"),
        ({"precision": "bf16", "device": "cpu"}, "bf16"),
        ({"pipeline": 2}, "split points"),
        ({"pipeline": 2, "split_points": ("1", "2")}, "need 1 split points"),
        ({"pipeline": 2, "split_points": ("2",), "stage_modules": (("0",), ("2",))}, "not both"),
        ({"pipeline": 2, "stages_per_rank": 2, "split_points": ("1", "2", "3")}, "one stage per rank"),
        ({"data_parallel": 0}, ">= 1"),
        ({"microbatches": 4}, "pipeline >= 2"),
        ({"sharded": True}, "data_parallel >= 2"),
        ({"data_parallel": 2, "sharded": True, "pipeline": 2, "split_points": ("2",)}, "not supported"),
        ({"schedule": "zero-bubble"}, "schedule must be one of"),
    ],
)
def test_invalid_plans_raise_config_error(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ParallelPlan(**kwargs)  # type: ignore[arg-type]


def test_from_mapping_and_cli_agree_and_round_trip() -> None:
    table = {"dp": 2, "pp": 2, "split-points": ["2"], "microbatches": 4, "schedule": "1f1b", "sharded": False}
    cli = ["dp=2", "pp=2", "split_points=2", "microbatches=4", "schedule=1F1B", "sharded=false"]
    plan = ParallelPlan.from_mapping(table)
    assert plan == ParallelPlan.from_cli(cli)
    assert ParallelPlan.from_mapping(plan.to_mapping()) == plan
    stages = ParallelPlan.from_cli(["pp=2", "stage_modules=0,1;2,3,4"])
    assert stages.stage_modules == (("0", "1"), ("2", "3", "4"))


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["dp"], "key=value"),
        (["gpus=2"], "unknown parallel plan option"),
        (["dp=two"], "integer"),
        (["dp=1", "dp=2"], r"'data_parallel' is given twice in --parallel \(as 'dp'\)"),
        (["dp=1", "data_parallel=2"], r"'data_parallel' is given twice in --parallel \(as 'dp' and 'data_parallel'\)"),
        (["fsdp=true", "shard=false"], r"'sharded' is given twice"),
    ],
)
def test_from_cli_errors(items: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ParallelPlan.from_cli(items)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"pp": 2, "split_points": True}, r"split_points must be module names, .* got True"),
        ({"pp": 2, "split_points": None}, r"split_points must be module names, .* got None"),
        ({"pp": 2, "split_points": [["2"]]}, r"split_points must be module names, .* got \[\['2'\]\]"),
        ({"pp": 2, "split_points": [2.5]}, r"split_points must be module names"),
        ({"pp": 2, "stage_modules": 5}, r"stage_modules must list each stage's module names, .* got 5"),
        ({"pp": 2, "stage_modules": [["0", "1"], 7.0]}, r"each stage of stage_modules must be module names"),
    ],
)
def test_module_names_of_the_wrong_type_raise_config_error(table: dict[str, object], message: str) -> None:
    """A TOML value that is no list of names is refused with the accepted forms, not a TypeError."""
    with pytest.raises(ConfigError, match=message):
        ParallelPlan.from_mapping(table)


def test_stage_modules_as_a_list_of_comma_separated_strings() -> None:
    """Each string is one stage's names, as between the semicolons on a command line; not its characters."""
    expected = (("0", "1"), ("2", "3", "4"))
    assert ParallelPlan.from_mapping({"pp": 2, "stage_modules": ["0,1", "2, 3,4"]}).stage_modules == expected
    assert ParallelPlan.from_mapping({"pp": 2, "stage_modules": [["0", 1], [2, "3", "4"]]}).stage_modules == expected
    plan = ParallelPlan.from_mapping({"pp": 2, "stage_modules": ["0,1", "2,3,4"]})
    plan.check_model(mlp())
    assert ParallelPlan(pipeline=2, split_points="2").split_points == ("2",)  # type: ignore[arg-type]
    assert ParallelPlan.from_mapping({"pp": 2, "split_points": 2}).split_points == (
        "2",
    )  # --set parallel.split_points=2


def test_flags_win_over_the_file_under_any_name() -> None:
    """``--parallel dp=3`` overrides the file's ``data_parallel = 2`` (and the other way round), keeping its other
    options; two names of one option in the file itself are refused."""
    table = {"data_parallel": 2, "microbatches": 4, "pp": 2, "split_points": "2"}
    plan = ParallelPlan.from_cli(["dp=3", "microbatch=8"], table)
    assert (plan.data_parallel, plan.pipeline, plan.microbatches, plan.split_points) == (3, 2, 8, ("2",))
    assert ParallelPlan.from_cli(["data-parallel=1"], {"dp": 2}).data_parallel == 1
    with pytest.raises(ConfigError, match=r"given twice in the \[parallel\] table \(as 'dp' and 'data_parallel'\)"):
        ParallelPlan.from_cli(["pp=2"], {"dp": 2, "data_parallel": 2})
    with pytest.raises(ConfigError, match=r"given twice in the \[parallel\] table"):
        ParallelPlan.from_mapping({"microbatch": 2, "microbatches": 2})


def test_layers_flatten_nested_sequentials() -> None:
    assert [name for name, _ in model_layers(deep_mlp())] == ["0.0", "0.1", "1.0", "1.1", "2.0", "2.1", "3"]
    with pytest.raises(ConfigError, match=r"nn\.Sequential or give it a pipeline_layers"):
        model_layers(nn.Linear(2, 2))


def test_a_module_the_sequential_repeats_is_a_layer_each_time() -> None:
    model = reused_mlp()
    assert [name for name, _ in model_layers(model)] == ["0", "1", "2", "3", "4"]
    ParallelPlan(pipeline=2, split_points=("3",)).check_model(model)  # both uses in stage 0
    with pytest.raises(ConfigError, match=r"'0\.weight' of stage 0 is also '2\.weight' of stage 1 \(tied weights\)"):
        ParallelPlan(pipeline=2, split_points=("1",)).check_model(model)
    with pytest.raises(ConfigError, match=r"tied weights"):
        ParallelPlan(pipeline=2, split_points=("2",)).check_model(model)


def test_split_stages_by_points_and_lists() -> None:
    stages = split_stages(deep_mlp(), num_stages=4, split_points=("1", "2", "3"))
    assert [[n for n, _ in s] for s in stages] == [["0.0", "0.1"], ["1.0", "1.1"], ["2.0", "2.1"], ["3"]]
    listed = split_stages(mlp(), num_stages=2, stage_modules=(("0", "1"), ("2", "3", "4")))
    assert [[n for n, _ in s] for s in listed] == [["0", "1"], ["2", "3", "4"]]


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (ParallelPlan(pipeline=2, split_points=("encoder",)), "names no module"),
        (ParallelPlan(pipeline=2, split_points=("0",)), "leave no stage empty"),
        (ParallelPlan(pipeline=2, stage_modules=(("0", "1"), ("3", "4"))), "model order"),
        (ParallelPlan(pipeline=2, stage_modules=(("0", "1"), ("2",))), "does not cover"),
        (ParallelPlan(activation_checkpointing=True), None),
    ],
)
def test_check_model(plan: ParallelPlan, message: str | None) -> None:
    if message is None:
        plan.check_model(mlp())
        return
    with pytest.raises(ConfigError, match=message):
        plan.check_model(mlp())


def test_split_point_inside_a_layer_is_rejected() -> None:
    model = nn.Sequential(nn.Linear(2, 2), _Block())
    with pytest.raises(ConfigError, match="inside a layer"):
        split_stages(model, num_stages=2, split_points=("1.inner",))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_tied_weights_across_stages_are_rejected() -> None:
    first, last = nn.Linear(3, 3), nn.Linear(3, 3)
    last.weight = first.weight
    with pytest.raises(ConfigError, match="tied weights"):
        split_stages(nn.Sequential(first, nn.Tanh(), last), num_stages=2, split_points=("2",))


def test_check_runtime_on_cpu() -> None:
    assert ParallelPlan(data_parallel=2).check_runtime().value == "cpu"
    with pytest.raises(ConfigError, match="bf16"):
        ParallelPlan(precision="bf16").check_runtime()  # type: ignore[arg-type]


def test_more_cpu_ranks_than_memory_holds_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """dp=100,000 on the CPU started one interpreter per rank (146 MiB of its own each before any data) until the
    machine ran out of memory; the refusal names the most ranks that fit. The free memory is set here (1000 MiB:
    6 ranks of 145), not read from this machine."""
    from fedcore.engine import plan as plan_module

    monkeypatch.setattr(plan_module, "available_memory_mib", lambda: 1000.0)
    with pytest.raises(ConfigError, match=r"7 ranks on the CPU .* lower the degrees \(data_parallel x pipeline x "):
        ParallelPlan(data_parallel=7).check_runtime()
    with pytest.raises(ConfigError, match=r"to at most 6 ranks$"):
        ParallelPlan(
            data_parallel=2, pipeline=2, split_points=("1",), microbatches=2, tensor_parallel=2
        ).check_runtime()
    assert ParallelPlan(data_parallel=6).check_runtime().value == "cpu"
    monkeypatch.setattr(plan_module, "available_memory_mib", lambda: None)  # no procfs: nothing to check against
    assert ParallelPlan(data_parallel=100_000).check_runtime().value == "cpu"


# ------------------------------------------------------------------------------------------ schedule rules
def test_stage_placement_is_looped() -> None:
    assert stages_of_rank(0, 2, 2) == [0, 2] and stages_of_rank(1, 2, 2) == [1, 3]
    assert [rank_of_stage(s, 2) for s in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ConfigError):
        stages_of_rank(2, 2, 1)


def test_schedule_requirements() -> None:
    check_schedule(Schedule.GPIPE, pipeline=4, stages_per_rank=1, microbatches=1)
    check_schedule(Schedule.ONE_F_ONE_B, pipeline=4, stages_per_rank=1, microbatches=4)
    check_schedule(Schedule.INTERLEAVED_1F1B, pipeline=2, stages_per_rank=2, microbatches=4)
    with pytest.raises(ConfigError, match="1F1B needs"):
        check_schedule(Schedule.ONE_F_ONE_B, pipeline=4, stages_per_rank=1, microbatches=3)
    with pytest.raises(ConfigError, match="multiple"):
        check_schedule(Schedule.INTERLEAVED_1F1B, pipeline=2, stages_per_rank=2, microbatches=3)
    with pytest.raises(ConfigError, match="stages_per_rank >= 2"):
        check_schedule(Schedule.INTERLEAVED_1F1B, pipeline=2, stages_per_rank=1, microbatches=4)


def test_bubble_fraction_by_hand() -> None:
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(2, 4, stages_per_rank=2) == pytest.approx(1 / 9)


def test_one_f_one_b_keeps_at_most_p_micro_batches_alive() -> None:
    for p in (2, 4):
        for m in (p, 2 * p, 8):
            for rank in range(p):
                order = one_f_one_b_order(rank, p, m)
                assert sorted(order) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
                assert peak_in_flight(order) == min(p - rank, m)
    # GPipe (all forwards, then all backwards) keeps all m alive
    assert peak_in_flight([("F", i) for i in range(8)] + [("B", i) for i in range(8)]) == 8


def _daemon_plan(argv: list[str]) -> ParallelPlan | None:
    """The plan ``fedcore client start ARGV`` would train under (its config built as the command builds it)."""
    from client.daemon import load_daemon_config
    from fedcore.cli import build_parser, client_options
    from fedcore.options import given_values

    args = build_parser().parse_args(["client", "start", "--server", "h:1", "--client-id", "c", "--insecure", *argv])
    config = load_daemon_config(
        args.config,
        args.overrides,
        given_values(args, client_options()),
        parallel_items=args.parallel,
        parallel_file=args.parallel_config,
    )
    return config.parallel


def test_client_start_flags_refine_the_parallel_config_file(tmp_path: Path) -> None:
    """``fedcore client start --parallel-config pc.toml --parallel dp=3`` with ``data_parallel = 2`` in the file."""
    path = tmp_path / "pc.toml"
    path.write_text("[parallel]\ndata_parallel = 2\nsharded = true\n")
    plan = _daemon_plan(["--parallel-config", str(path), "--parallel", "dp=3"])
    assert plan is not None and (plan.data_parallel, plan.sharded) == (3, True)
    with pytest.raises(ConfigError, match="given twice in --parallel"):
        _daemon_plan(["--parallel-config", str(path), "--parallel", "dp=3", "dp=2"])
    assert _daemon_plan([]) is None


def test_set_parallel_refines_the_plan_beside_the_parallel_flags(tmp_path: Path) -> None:
    """``--set parallel.KEY=VALUE`` was dropped whenever ``--parallel`` or ``--parallel-config`` was also given: the
    daemon trained on one device without a word, or refused the plan for a key the --set had given."""
    pipeline = ["--set", "parallel.pipeline=2", "--set", 'parallel.split_points=["2"]', "--set",
                "parallel.microbatches=2"]  # fmt: skip
    plan = _daemon_plan([*pipeline, "--parallel", "schedule=gpipe"])
    assert plan is not None
    assert (plan.pipeline, plan.split_points, plan.microbatches, plan.schedule.value) == (2, ("2",), 2, "gpipe")
    config = tmp_path / "c.toml"
    config.write_text('[parallel]\ndp = 2\nschedule = "1f1b"\nmicrobatches = 1\n')
    plan = _daemon_plan(["--config", str(config), "--set", "parallel.microbatches=4", "--parallel", "pp=2",
                         "split_points=2"])  # fmt: skip
    assert plan is not None and (plan.data_parallel, plan.pipeline, plan.microbatches) == (2, 2, 4)
    # --set wins over the file under another name of the option, and --parallel over both
    plan = _daemon_plan(["--parallel-config", str(config), "--set", "parallel.data_parallel=3"])
    assert plan is not None and plan.data_parallel == 3
    plan = _daemon_plan(["--config", str(config), "--set", "parallel.data_parallel=3", "--parallel", "dp=4"])
    assert plan is not None and plan.data_parallel == 4
    # an inline table is the same as its keys one by one
    plan = _daemon_plan(["--parallel-config", str(config), "--set", "parallel={data_parallel=3}"])
    assert plan is not None and (plan.data_parallel, plan.schedule.value) == (3, "1f1b")
