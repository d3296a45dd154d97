"""Simulated devices (simulations/devices.py): availability traces by hand, and a small simulation whose rounds take
their slowest client's simulated time and select only online clients."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fedcore.errors import ConfigError
from fedcore.selection import SelectionConfig, Selector
from simulations.config import load_recipe
from simulations.devices import (
    DevicesConfig,
    availability_trace,
    diurnal,
    fit_seconds,
    online_counts,
    read_trace,
    simulation_selector,
    slow_clients,
)
from simulations.harness import client_ids, partition_sizes, run_simulation


def test_csv_trace_by_hand(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("client,from_round,to_round\nc0,1,2\nc0,5,5\nc1,3,4\n")
    online = read_trace(path)
    assert [r for r in range(1, 8) if online("c0", r)] == [1, 2, 5]
    assert [r for r in range(1, 8) if online("c1", r)] == [3, 4]
    assert all(online("c2", r) for r in range(1, 8))  # not listed: always online
    config = DevicesConfig(availability="csv", availability_file=path)
    trace = availability_trace(config, ["c0", "c1", "c2"], seed=0)
    assert trace is not None and not trace("c0", 3)
    with pytest.raises(ConfigError, match=r"names none of the run's clients \(it lists 'c0', 'c1'\)"):
        availability_trace(config, ["client-000", "client-001"], seed=0)  # ids of another naming: silently ignored
    path.write_text("client,from_round,to_round\n")
    assert read_trace(path)("c0", 1)  # no rows: everyone online, but a run refuses such a file
    with pytest.raises(ConfigError, match="it lists no client"):
        availability_trace(config, ["c0", "c1"], seed=0)
    for text, problem in (("client,round\nc0,1\n", "header"), ("client,from_round,to_round\nc0,3,2\n", "line 2")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=problem):
            read_trace(path)
    with pytest.raises(ConfigError, match="cannot read"):
        read_trace(tmp_path / "missing.csv")
    path.write_bytes(b"\xff\xfec\x00l\x00")  # UTF-16 (a spreadsheet's "Unicode text" export)
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        read_trace(path)
    # a byte-order mark and a blank last line (a spreadsheet's UTF-8 export, an editor) are taken; they were refused
    path.write_bytes("\ufeffclient,from_round,to_round\nc0,2,3\n\n".encode())
    assert [r for r in range(1, 5) if read_trace(path)("c0", r)] == [2, 3]
    # a fourth column and rounds in other scripts' digits were taken without a word
    for row in ("c0,1,2,junk", "c0,\u0661,\u0662"):
        path.write_text(f"client,from_round,to_round\n{row}\n")
        with pytest.raises(ConfigError, match=r"line 2: expected client,from_round,to_round \(three columns"):
            read_trace(path)


def test_a_trace_that_is_a_pipe_or_a_device_is_refused_not_waited_on(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "trace.csv")  # opening it would wait for a writer
    for path in (tmp_path / "trace.csv", Path("/dev/zero")):
        with pytest.raises(ConfigError, match=r"devices\.availability_file .* is not a regular file; give the path of"):
            read_trace(path)


def test_diurnal_trace_by_hand() -> None:
    # period 10, 30% online: phase 0 -> rounds = 0, 1, 2 (mod 10); phase .75 -> r/10 in [.25, .55): 3, 4, 5
    online = diurnal({"a": 0.0, "b": 0.75}, online_fraction=0.3, period=10)
    assert [r for r in range(1, 21) if online("a", r)] == [1, 2, 10, 11, 12, 20]
    assert [r for r in range(1, 21) if online("b", r)] == [3, 4, 5, 13, 14, 15]
    assert online("unknown", 7)
    # phases from the seed: every client online 3 rounds of every 10
    ids = [f"c{i}" for i in range(20)]
    trace = availability_trace(DevicesConfig(availability="diurnal", online_fraction=0.3, period=10), ids, seed=4)
    assert trace is not None
    assert all(sum(trace(cid, r) for r in range(11, 21)) == 3 for cid in ids)
    assert availability_trace(DevicesConfig(), ids, seed=4) is None


def test_devices_config_checks(tmp_path: Path) -> None:
    bad_values: list[dict[str, object]] = [
        {"slow_fraction": 1.5},
        {"slowdown": 0.5},
        {"step_seconds": 0.0},
        {"availability": "sometimes"},
        {"online_fraction": 0.0},
        {"period": 0},
        {"availability": "csv"},
        {"availability_file": tmp_path / "t.csv"},
    ]
    for bad in bad_values:
        with pytest.raises(ConfigError, match="devices"):
            DevicesConfig(**bad)  # type: ignore[arg-type]


SMALL = [
    "data.dataset=digits",
    "data.num_clients=6",
    "data.partition=iid",
    "model.name=logreg",
    "sampling.min_fit_clients=2",
    "sampling.fraction_fit=1.0",
    "train.batch_size=32",
    "rounds=3",
    "evaluate_every=3",
    "output.progress=false",
    "output.plot=false",
]


def test_a_simulation_times_its_rounds_and_selects_only_online_clients(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"  # round 2: only client-004 and client-005 are online
    rows = "".join(f"client-00{i},1,1\nclient-00{i},3,3\n" for i in range(4))
    trace.write_text("client,from_round,to_round\n" + rows)
    extra = [
        "strategy.selection=oort",
        "devices.slow_fraction=0.5",
        "devices.slowdown=5.0",
        "devices.availability=csv",
        f"devices.availability_file={str(trace)!r}",
    ]
    config = load_recipe(None, [*SMALL, f"output.dir={str(tmp_path / 'run')!r}", *extra])
    history = run_simulation(config, echo=lambda _: None).history
    assert list(history["clients"]) == [0, 6, 2, 6]
    ids = client_ids(6)
    sizes = partition_sizes(config, ids)
    slow = slow_clients(ids, 0.5, seed=0)
    # every client trains in rounds 1 and 3: the slowest of all; round 2: the slower of client-004 and client-005
    time = {cid: fit_seconds(5.0 if cid in slow else 1.0, 0.01, 1, 32, sizes[cid]) for cid in ids}
    assert list(history["simulated_seconds"][1:]) == pytest.approx(
        [max(time.values()), max(time["client-004"], time["client-005"]), max(time.values())]
    )
    # without devices options (and another policy) the history has no such column: pinned histories stay as they are
    plain_config = load_recipe(None, [*SMALL, f"output.dir={str(tmp_path / 'plain')!r}", "rounds=1"])
    plain = run_simulation(plain_config, echo=lambda _: None)
    assert "simulated_seconds" not in plain.history.columns


def test_a_step_cap_caps_the_simulated_time(tmp_path: Path) -> None:
    """--max-steps 1 with 3 epochs: every client takes one step (training stops there), so a round lasts one step
    of the slowest device, 5 x 0.01 s. The device model counted every epoch's batches (0.15 s and more), and Oort
    then penalised clients for data they never trained on."""
    extra = ["train.max_steps=1", "train.local_epochs=3", "devices.slow_fraction=0.5", "devices.slowdown=5.0"]
    config = load_recipe(None, [*SMALL, f"output.dir={str(tmp_path / 'run')!r}", *extra])
    history = run_simulation(config, echo=lambda _: None).history
    assert list(history["simulated_seconds"][1:]) == pytest.approx([5 * 0.01] * (len(history) - 1))
    assert fit_seconds(5.0, 0.02, 3, 10, 25, max_steps=4) == pytest.approx(0.4)  # 9 steps, capped at 4
    assert fit_seconds(5.0, 0.02, 3, 10, 25, max_steps=100) == pytest.approx(0.9)


def test_a_refused_update_still_takes_its_simulated_time(tmp_path: Path) -> None:
    """Half the clients (drawn from the seed) send updates of infinities and are refused; the synchronous round
    still waited for them, so it lasts as long as its slowest client, refused or not. Only the accepted updates
    were timed, and the slowest device, an attacker's, was left out of the history."""
    from simulations.attacks import AttackConfig, choose_attackers

    extra = ["devices.slow_fraction=0.2", "devices.slowdown=5.0", "attack.kind=scale", "attack.scale=1e300",
             "attack.fraction=0.5"]  # fmt: skip
    config = load_recipe(None, [*SMALL, f"output.dir={str(tmp_path / 'run')!r}", *extra])
    history = run_simulation(config, echo=lambda _: None).history
    ids = client_ids(6)
    sizes = partition_sizes(config, ids)
    slow = slow_clients(ids, 0.2, seed=0)  # client-002, one of the attackers
    attackers = choose_attackers(ids, AttackConfig(kind="scale", fraction=0.5), seed=0)
    time = {cid: fit_seconds(5.0 if cid in slow else 1.0, 0.01, 1, 32, sizes[cid]) for cid in ids}
    assert max(time[cid] for cid in ids if cid not in attackers) < max(time.values())  # an attacker is slowest
    assert list(history["failures"][1:]) == [3, 3, 3]
    assert list(history["simulated_seconds"][1:]) == pytest.approx([max(time.values())] * 3)


@pytest.mark.parametrize("kind", ["diurnal", "csv"])
def test_online_counts_are_what_the_selection_sees(kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The counts a simulation checks at start equal, round by round, the clients the selector has online. A row
    naming no client of the run (a typo) is ignored with a warning; it was ignored without one."""
    ids = client_ids(40)
    trace = tmp_path / "trace.csv"
    rows = [f"{cid},{1 + i % 7},{1 + i % 7 + i % 11}\n" for i, cid in enumerate(ids[:30])]  # 10 listed nowhere
    rows += [f"{ids[0]},2,5\n", f"{ids[1]},20,30\n", "client-999,1,9\n"]  # overlapping, late, not a client
    trace.write_text("client,from_round,to_round\n" + "".join(rows))
    devices = (
        DevicesConfig(availability="diurnal", online_fraction=0.3, period=7)
        if kind == "diurnal"
        else DevicesConfig(availability="csv", availability_file=trace)
    )
    counts = online_counts(devices, ids, seed=3, rounds=25)
    online = availability_trace(devices, ids, seed=3)
    assert counts is not None and online is not None
    assert counts.tolist() == [sum(online(cid, r) for cid in ids) for r in range(1, 26)]
    assert counts.min() < counts.max()  # the trace varies: the comparison means something
    if kind == "csv":  # said once, though both read the file
        assert caplog.text.count("names 1 id(s) that are no client of this run ('client-999'): their rows are") == 1


def test_a_trace_too_thin_for_min_fit_clients_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """Round 4 of this trace has 1 client online, and every round needs 2: the run wrote its output, trained rounds
    1-3 and failed at round 4, and every --resume failed there again (the trace is fixed)."""
    trace = tmp_path / "trace.csv"
    rows = "".join(f"client-00{i},1,3\nclient-00{i},5,9\n" for i in range(1, 6))  # client-000: always online
    trace.write_text("client,from_round,to_round\n" + rows)
    out = tmp_path / "run"
    extra = ["devices.availability=csv", f"devices.availability_file={str(trace)!r}", "rounds=6"]
    with pytest.raises(ConfigError, match=r"has 1 of the 6 clients online in round 4, and a round needs min_fit_clie"):
        run_simulation(load_recipe(None, [*SMALL, f"output.dir={str(out)!r}", *extra]), echo=lambda _: None)
    assert not out.exists()
    history = run_simulation(  # three rounds never reach round 4
        load_recipe(None, [*SMALL, f"output.dir={str(out)!r}", *extra[:2], "rounds=3"]), echo=lambda _: None
    ).history
    assert list(history["round"]) == [0, 1, 2, 3]


def test_stratified_by_size_in_simulation_takes_each_bucket_in_proportion() -> None:
    ids = [f"c{i}" for i in range(8)]
    sizes = {cid: 10 * (i + 1) for i, cid in enumerate(ids)}  # c0..c3 the small half, c4..c7 the large
    selection = Selector("stratified", SelectionConfig(size_buckets=2))
    selector = simulation_selector(selection, DevicesConfig(), ids, seed=0, sizes=lambda: sizes)
    for rnd in range(1, 11):
        picked = selector.select(ids, 4, seed=0, round=rnd)
        assert sum(c in ("c0", "c1", "c2", "c3") for c in picked) == 2
    # other policies do not need the sizes
    uniform = simulation_selector(Selector(), DevicesConfig(), ids, seed=0, sizes=lambda: {})
    assert uniform.policy == "uniform" and uniform.availability is None


def test_stratifying_virtual_clients_by_an_attribute_they_lack_is_refused() -> None:
    # virtual clients carry only 'size': any other attribute put every client in one stratum, silently uniform
    with pytest.raises(ConfigError, match=r"stratify_by = 'region': in simulation the clients' only attribute"):
        load_recipe(None, ["strategy.selection='stratified'", "strategy.selector.stratify_by='region'"])
    assert load_recipe(None, ["strategy.selection='stratified'"]).strategy.selector.stratify_by == "size"
    # the other policies ignore the stratified policy's parameter, so one recipe can compare them
    assert load_recipe(None, ["strategy.selector.stratify_by='region'"]).strategy.selection == "uniform"


def test_client_level_dp_is_refused_with_a_selection_that_is_not_uniform() -> None:
    with pytest.raises(ConfigError, match="selection 'oort', which chooses by other rules, would make its epsilon"):
        load_recipe(None, ["privacy.dp='central'", "strategy.selection='oort'"])
    with pytest.raises(ConfigError, match="an availability trace"):
        load_recipe(None, ["privacy.dp='central'", "devices.availability='diurnal'"])
    assert load_recipe(None, ["privacy.dp='central'"]).strategy.selection == "uniform"
    assert load_recipe(None, ["strategy.selection='oort'"]).privacy.dp == "off"


def test_a_diurnal_day_shorter_than_one_online_round_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """online_fraction 0.25 of a 3-round period is 0.75 rounds online a period: some clients were never online
    (client-003 in no round of 12) and others once a period, without a word."""
    ids = client_ids(8)
    online = availability_trace(DevicesConfig(availability="diurnal", online_fraction=0.25, period=3), ids, seed=0)
    assert online is not None
    assert any(not any(online(cid, r) for r in range(1, 13)) for cid in ids)
    assert "some clients are never online and the others once a period; raise --period to at least 4" in caplog.text
    caplog.clear()
    availability_trace(DevicesConfig(availability="diurnal", online_fraction=0.25, period=8), ids, seed=0)
    assert caplog.text == ""
