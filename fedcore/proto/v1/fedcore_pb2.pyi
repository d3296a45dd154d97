from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Stage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STAGE_UNSPECIFIED: _ClassVar[Stage]
    STAGE_FIT: _ClassVar[Stage]
    STAGE_EVALUATE: _ClassVar[Stage]
    STAGE_PROTOCOL: _ClassVar[Stage]
STAGE_UNSPECIFIED: Stage
STAGE_FIT: Stage
STAGE_EVALUATE: Stage
STAGE_PROTOCOL: Stage

class JoinRequest(_message.Message):
    __slots__ = ("client_id", "token", "attributes")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    token: str
    attributes: _containers.ScalarMap[str, str]
    def __init__(self, client_id: _Optional[str] = ..., token: _Optional[str] = ..., attributes: _Optional[_Mapping[str, str]] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("session", "seed", "heartbeat_interval_s", "liveness_timeout_s", "max_payload_bytes", "chunk_bytes")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    LIVENESS_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    session: str
    seed: int
    heartbeat_interval_s: float
    liveness_timeout_s: float
    max_payload_bytes: int
    chunk_bytes: int
    def __init__(self, session: _Optional[str] = ..., seed: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., liveness_timeout_s: _Optional[float] = ..., max_payload_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    def __init__(self, ok: _Optional[bool] = ...) -> None: ...

class PullTaskRequest(_message.Message):
    __slots__ = ("session", "wait_s")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    session: str
    wait_s: float
    def __init__(self, session: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class StageValue(_message.Message):
    __slots__ = ("bytes_value", "int_value", "str_value")
    BYTES_VALUE_FIELD_NUMBER: _ClassVar[int]
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    STR_VALUE_FIELD_NUMBER: _ClassVar[int]
    bytes_value: bytes
    int_value: int
    str_value: str
    def __init__(self, bytes_value: _Optional[bytes] = ..., int_value: _Optional[int] = ..., str_value: _Optional[str] = ...) -> None: ...

class StageMessage(_message.Message):
    __slots__ = ("protocol", "name", "fields", "attempt")
    class FieldsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: StageValue
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[StageValue, _Mapping]] = ...) -> None: ...
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    protocol: str
    name: str
    fields: _containers.MessageMap[str, StageValue]
    attempt: int
    def __init__(self, protocol: _Optional[str] = ..., name: _Optional[str] = ..., fields: _Optional[_Mapping[str, StageValue]] = ..., attempt: _Optional[int] = ...) -> None: ...

class FitConfig(_message.Message):
    __slots__ = ("local_epochs", "batch_size", "lr", "momentum", "weight_decay", "mu", "max_steps", "values")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ConfigValue
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ConfigValue, _Mapping]] = ...) -> None: ...
    LOCAL_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MU_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    local_epochs: int
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    mu: float
    max_steps: int
    values: _containers.MessageMap[str, ConfigValue]
    def __init__(self, local_epochs: _Optional[int] = ..., batch_size: _Optional[int] = ..., lr: _Optional[float] = ..., momentum: _Optional[float] = ..., weight_decay: _Optional[float] = ..., mu: _Optional[float] = ..., max_steps: _Optional[int] = ..., values: _Optional[_Mapping[str, ConfigValue]] = ...) -> None: ...

class ConfigValue(_message.Message):
    __slots__ = ("int_value", "float_value", "bool_value", "string_value")
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    FLOAT_VALUE_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    STRING_VALUE_FIELD_NUMBER: _ClassVar[int]
    int_value: int
    float_value: float
    bool_value: bool
    string_value: str
    def __init__(self, int_value: _Optional[int] = ..., float_value: _Optional[float] = ..., bool_value: _Optional[bool] = ..., string_value: _Optional[str] = ...) -> None: ...

class TaskHeader(_message.Message):
    __slots__ = ("task_id", "round", "stage", "seed", "fit", "evaluate_batch_size", "payload_bytes", "deadline_s", "mods", "protocol_stage")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FIT_FIELD_NUMBER: _ClassVar[int]
    EVALUATE_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    MODS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_STAGE_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    round: int
    stage: Stage
    seed: int
    fit: FitConfig
    evaluate_batch_size: int
    payload_bytes: int
    deadline_s: float
    mods: _containers.RepeatedCompositeFieldContainer[ModSpec]
    protocol_stage: StageMessage
    def __init__(self, task_id: _Optional[str] = ..., round: _Optional[int] = ..., stage: _Optional[_Union[Stage, str]] = ..., seed: _Optional[int] = ..., fit: _Optional[_Union[FitConfig, _Mapping]] = ..., evaluate_batch_size: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., deadline_s: _Optional[float] = ..., mods: _Optional[_Iterable[_Union[ModSpec, _Mapping]]] = ..., protocol_stage: _Optional[_Union[StageMessage, _Mapping]] = ...) -> None: ...

class ModSpec(_message.Message):
    __slots__ = ("name", "params")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ModParam
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ModParam, _Mapping]] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    params: _containers.MessageMap[str, ModParam]
    def __init__(self, name: _Optional[str] = ..., params: _Optional[_Mapping[str, ModParam]] = ...) -> None: ...

class ModParam(_message.Message):
    __slots__ = ("flag", "integer", "number", "text")
    FLAG_FIELD_NUMBER: _ClassVar[int]
    INTEGER_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    flag: bool
    integer: int
    number: float
    text: str
    def __init__(self, flag: _Optional[bool] = ..., integer: _Optional[int] = ..., number: _Optional[float] = ..., text: _Optional[str] = ...) -> None: ...

class Trailer(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: bytes
    def __init__(self, sha256: _Optional[bytes] = ...) -> None: ...

class Idle(_message.Message):
    __slots__ = ("finished",)
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    finished: bool
    def __init__(self, finished: _Optional[bool] = ...) -> None: ...

class TaskChunk(_message.Message):
    __slots__ = ("header", "data", "trailer", "idle")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    header: TaskHeader
    data: bytes
    trailer: Trailer
    idle: Idle
    def __init__(self, header: _Optional[_Union[TaskHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., trailer: _Optional[_Union[Trailer, _Mapping]] = ..., idle: _Optional[_Union[Idle, _Mapping]] = ...) -> None: ...

class ResultHeader(_message.Message):
    __slots__ = ("session", "task_id", "round", "stage", "num_examples", "metrics", "loss", "failure", "payload_bytes", "protocol_stage")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_STAGE_FIELD_NUMBER: _ClassVar[int]
    session: str
    task_id: str
    round: int
    stage: Stage
    num_examples: int
    metrics: _containers.ScalarMap[str, float]
    loss: float
    failure: str
    payload_bytes: int
    protocol_stage: StageMessage
    def __init__(self, session: _Optional[str] = ..., task_id: _Optional[str] = ..., round: _Optional[int] = ..., stage: _Optional[_Union[Stage, str]] = ..., num_examples: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., loss: _Optional[float] = ..., failure: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., protocol_stage: _Optional[_Union[StageMessage, _Mapping]] = ...) -> None: ...

class ResultChunk(_message.Message):
    __slots__ = ("header", "data", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: ResultHeader
    data: bytes
    trailer: Trailer
    def __init__(self, header: _Optional[_Union[ResultHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., trailer: _Optional[_Union[Trailer, _Mapping]] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("accepted", "duplicate", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    duplicate: bool
    reason: str
    def __init__(self, accepted: _Optional[bool] = ..., duplicate: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
