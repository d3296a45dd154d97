"""FitConfig is declared once: every conversion (protobuf, the engine's spec, Flower's dict, CLI flags) derives
from the dataclass's fields, so a new field travels everywhere with no other edit."""

from __future__ import annotations

import dataclasses

import pytest

from client.flower import fit_config_dict
from fedcore.config import ScalarField, field_docs, from_mapping, scalar_fields
from fedcore.errors import ConfigError
from fedcore.options import plain_text
from fedcore.proto.v1 import fedcore_pb2 as pb
from fedcore.task import FitConfig
from fedcore.wire import fit_config_from_pb, fit_config_to_pb

#: a config in which every field differs from its default (so a conversion that drops a field is caught)
NON_DEFAULT = FitConfig(local_epochs=3, batch_size=17, lr=0.125, momentum=0.5, weight_decay=0.001, mu=0.25,
                        max_steps=9, report_validation=True)  # fmt: skip


def test_every_field_differs_from_its_default_in_the_probe() -> None:
    # if a field is added to FitConfig, extend NON_DEFAULT; this test says so rather than passing vacuously
    for f in scalar_fields(FitConfig):
        assert getattr(NON_DEFAULT, f.name) != f.default, f"give NON_DEFAULT a non-default {f.name}"


def test_fields_carry_type_default_and_help_from_the_dataclass() -> None:
    fields = {f.name: f for f in scalar_fields(FitConfig)}
    assert fields["lr"] == ScalarField("lr", float, False, 0.05, "local SGD learning rate (eta_l). > 0.")
    assert fields["max_steps"].kind is int and fields["max_steps"].optional and fields["max_steps"].default is None
    assert fields["mu"].help.startswith("FedProx proximal coefficient") and "plain FedAvg" in fields["mu"].help
    assert list(fields) == [f.name for f in dataclasses.fields(FitConfig)]


def test_protobuf_round_trip_keeps_every_field() -> None:
    for config in (FitConfig(), NON_DEFAULT):
        message = pb.FitConfig.FromString(fit_config_to_pb(config).SerializeToString())
        assert fit_config_from_pb(message) == config
    assert "max_steps" not in fit_config_to_pb(FitConfig()).values  # unset optional: absent, not 0


def test_old_daemons_still_read_the_typed_fields() -> None:
    # a daemon older than the map reads fields 1-7 only
    message = fit_config_to_pb(NON_DEFAULT)
    assert (message.local_epochs, message.batch_size, message.lr, message.momentum) == (3, 17, 0.125, 0.5)
    assert (message.weight_decay, message.mu, message.max_steps) == (0.001, 0.25, 9)
    assert fit_config_to_pb(FitConfig()).max_steps == 0  # None travels there as 0, as before


def test_messages_of_old_servers_are_read_from_the_typed_fields() -> None:
    old = pb.FitConfig(local_epochs=2, batch_size=8, lr=0.5, momentum=0.9, weight_decay=0.0, mu=0.1, max_steps=0)
    assert fit_config_from_pb(old) == FitConfig(local_epochs=2, batch_size=8, lr=0.5, momentum=0.9, mu=0.1)
    with pytest.raises(ConfigError, match="local_epochs must be >= 1"):
        fit_config_from_pb(pb.FitConfig())  # an empty message is refused, not trained with zeros


def test_unknown_and_mistyped_values_are_refused_clearly() -> None:
    message = fit_config_to_pb(FitConfig())
    message.values["clip_norm"].float_value = 1.0
    with pytest.raises(ConfigError, match=r"'clip_norm'.*newer fedcore; upgrade fedcore on this client"):
        fit_config_from_pb(message)
    message = fit_config_to_pb(FitConfig())
    message.values["batch_size"].string_value = "32"
    with pytest.raises(ConfigError, match="batch_size as string_value, expected int"):
        fit_config_from_pb(message)
    message = fit_config_to_pb(FitConfig())
    message.values["lr"].int_value = 2  # an int for a float field is the float it stands for
    assert fit_config_from_pb(message).lr == 2.0


def test_engine_spec_and_flower_dict_cover_every_field() -> None:
    spec = dataclasses.asdict(NON_DEFAULT)  # what fedcore.engine.train writes for its workers
    assert FitConfig(**spec) == NON_DEFAULT
    flower = fit_config_dict(NON_DEFAULT, server_round=4, seed=11)
    assert flower == {"server_round": 4, "seed": 11, **spec}
    assert type(flower["lr"]) is float and type(flower["batch_size"]) is int
    assert "max_steps" not in fit_config_dict(FitConfig(), server_round=1, seed=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExtendedFitConfig(FitConfig):
    """FitConfig with fields a later version might add.

    Attributes:
        clip_norm: a float with a default.
        compressor: a string.
        warmup: a bool.
        keep_every: an optional int.
    """

    clip_norm: float = 1.0
    compressor: str = "none"
    warmup: bool = False
    keep_every: int | None = None


def test_a_new_field_is_one_edit_of_the_dataclass() -> None:
    config = ExtendedFitConfig(lr=0.2, clip_norm=0.5, compressor="topk", warmup=True, keep_every=4)
    message = pb.FitConfig.FromString(fit_config_to_pb(config).SerializeToString())
    assert fit_config_from_pb(message, ExtendedFitConfig) == config
    assert fit_config_from_pb(fit_config_to_pb(ExtendedFitConfig()), ExtendedFitConfig) == ExtendedFitConfig()
    flower = fit_config_dict(config, server_round=1, seed=0)
    assert (flower["clip_norm"], flower["compressor"], flower["warmup"], flower["keep_every"]) == (0.5, "topk", True, 4)
    assert from_mapping(ExtendedFitConfig, {"compressor": "topk", "warmup": "true"}).warmup is True
    assert field_docs(ExtendedFitConfig)["lr"].startswith("local SGD learning rate")  # inherited entries too
    # a client whose FitConfig lacks the new fields refuses them instead of silently training without them
    with pytest.raises(ConfigError, match="newer fedcore"):
        fit_config_from_pb(message)


def test_the_typed_proto_fields_never_drift_from_the_dataclass() -> None:
    # fields 1-7 are frozen; each must still be a FitConfig field of the same kind (the map carries the rest)
    kinds = {f.name: f.kind for f in scalar_fields(FitConfig)}
    for descriptor in pb.FitConfig.DESCRIPTOR.fields:
        if descriptor.name == "values":
            continue
        expected = {descriptor.CPPTYPE_INT32: int, descriptor.CPPTYPE_DOUBLE: float}[descriptor.cpp_type]
        assert kinds[descriptor.name] is expected, descriptor.name


def test_fields_that_cannot_travel_as_scalars_are_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Bad:
        """Attributes:
        sizes: a list.
        """

        sizes: tuple[int, ...] = ()

    with pytest.raises(ConfigError, match=r"Bad.sizes is declared .*must be int, float, bool, str"):
        scalar_fields(Bad)


def test_every_field_is_a_flag_of_simulate_and_server_start() -> None:
    from fedcore.cli import server_options, simulate_options

    for options in (server_options(), simulate_options()):
        by_key = {o.key: o for o in options}
        for f in scalar_fields(FitConfig):
            option = by_key[f"train.{f.name}"]
            # the flag's help is the field's doc with its Sphinx markup stripped for the terminal
            assert (option.kind, option.default, option.help) == (f.kind, f.default, plain_text(f.help))
