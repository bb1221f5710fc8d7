from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FaultSpec(_message.Message):
    __slots__ = ("step", "replica", "phase", "microbatch", "seconds", "rank")
    STEP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    step: int
    replica: int
    phase: str
    microbatch: int
    seconds: float
    rank: int
    def __init__(self, step: _Optional[int] = ..., replica: _Optional[int] = ..., phase: _Optional[str] = ..., microbatch: _Optional[int] = ..., seconds: _Optional[float] = ..., rank: _Optional[int] = ...) -> None: ...

class WorkloadSpec(_message.Message):
    __slots__ = ("command", "config_json")
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    command: _containers.RepeatedScalarFieldContainer[str]
    config_json: str
    def __init__(self, command: _Optional[_Iterable[str]] = ..., config_json: _Optional[str] = ...) -> None: ...

class SlowdownSpec(_message.Message):
    __slots__ = ("replica", "factor", "from_step", "until_step")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    UNTIL_STEP_FIELD_NUMBER: _ClassVar[int]
    replica: int
    factor: float
    from_step: int
    until_step: int
    def __init__(self, replica: _Optional[int] = ..., factor: _Optional[float] = ..., from_step: _Optional[int] = ..., until_step: _Optional[int] = ...) -> None: ...

class TestingConfig(_message.Message):
    __slots__ = ("faults", "compute_ms", "slowdowns", "overlap_piece_bytes", "digest_inline")
    FAULTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    SLOWDOWNS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_PIECE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_INLINE_FIELD_NUMBER: _ClassVar[int]
    faults: _containers.RepeatedCompositeFieldContainer[FaultSpec]
    compute_ms: float
    slowdowns: _containers.RepeatedCompositeFieldContainer[SlowdownSpec]
    overlap_piece_bytes: int
    digest_inline: bool
    def __init__(self, faults: _Optional[_Iterable[_Union[FaultSpec, _Mapping]]] = ..., compute_ms: _Optional[float] = ..., slowdowns: _Optional[_Iterable[_Union[SlowdownSpec, _Mapping]]] = ..., overlap_piece_bytes: _Optional[int] = ..., digest_inline: _Optional[bool] = ...) -> None: ...

class JobConfig(_message.Message):
    __slots__ = ("job_id", "replicas", "steps", "global_microbatches", "seed", "reduce", "group_timeout_s", "policy", "hang_timeout_s", "hang_factor", "first_microbatch_grace_s", "workload", "testing", "reduce_dtype", "check_determinism", "skip_batch_check", "record_sample_ids", "min_replicas", "spares", "checkpoint", "resume", "ranks_per_replica", "work_stealing", "reduce_after_backward", "group_backend")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REDUCE_FIELD_NUMBER: _ClassVar[int]
    GROUP_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    HANG_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    HANG_FACTOR_FIELD_NUMBER: _ClassVar[int]
    FIRST_MICROBATCH_GRACE_S_FIELD_NUMBER: _ClassVar[int]
    WORKLOAD_FIELD_NUMBER: _ClassVar[int]
    TESTING_FIELD_NUMBER: _ClassVar[int]
    REDUCE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHECK_DETERMINISM_FIELD_NUMBER: _ClassVar[int]
    SKIP_BATCH_CHECK_FIELD_NUMBER: _ClassVar[int]
    RECORD_SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SPARES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    RANKS_PER_REPLICA_FIELD_NUMBER: _ClassVar[int]
    WORK_STEALING_FIELD_NUMBER: _ClassVar[int]
    REDUCE_AFTER_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    GROUP_BACKEND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    replicas: int
    steps: int
    global_microbatches: int
    seed: int
    reduce: str
    group_timeout_s: float
    policy: str
    hang_timeout_s: float
    hang_factor: float
    first_microbatch_grace_s: float
    workload: WorkloadSpec
    testing: TestingConfig
    reduce_dtype: str
    check_determinism: bool
    skip_batch_check: bool
    record_sample_ids: bool
    min_replicas: int
    spares: int
    checkpoint: CheckpointConfig
    resume: ResumePoint
    ranks_per_replica: int
    work_stealing: bool
    reduce_after_backward: bool
    group_backend: str
    def __init__(self, job_id: _Optional[str] = ..., replicas: _Optional[int] = ..., steps: _Optional[int] = ..., global_microbatches: _Optional[int] = ..., seed: _Optional[int] = ..., reduce: _Optional[str] = ..., group_timeout_s: _Optional[float] = ..., policy: _Optional[str] = ..., hang_timeout_s: _Optional[float] = ..., hang_factor: _Optional[float] = ..., first_microbatch_grace_s: _Optional[float] = ..., workload: _Optional[_Union[WorkloadSpec, _Mapping]] = ..., testing: _Optional[_Union[TestingConfig, _Mapping]] = ..., reduce_dtype: _Optional[str] = ..., check_determinism: _Optional[bool] = ..., skip_batch_check: _Optional[bool] = ..., record_sample_ids: _Optional[bool] = ..., min_replicas: _Optional[int] = ..., spares: _Optional[int] = ..., checkpoint: _Optional[_Union[CheckpointConfig, _Mapping]] = ..., resume: _Optional[_Union[ResumePoint, _Mapping]] = ..., ranks_per_replica: _Optional[int] = ..., work_stealing: _Optional[bool] = ..., reduce_after_backward: _Optional[bool] = ..., group_backend: _Optional[str] = ...) -> None: ...

class CheckpointConfig(_message.Message):
    __slots__ = ("dir", "every_steps", "every_s", "keep")
    DIR_FIELD_NUMBER: _ClassVar[int]
    EVERY_STEPS_FIELD_NUMBER: _ClassVar[int]
    EVERY_S_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    dir: str
    every_steps: int
    every_s: float
    keep: int
    def __init__(self, dir: _Optional[str] = ..., every_steps: _Optional[int] = ..., every_s: _Optional[float] = ..., keep: _Optional[int] = ...) -> None: ...

class ResumePoint(_message.Message):
    __slots__ = ("path", "step")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class Ledger(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[StepRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[StepRecord, _Mapping]]] = ...) -> None: ...

class CheckpointMeta(_message.Message):
    __slots__ = ("job", "step", "state", "ledger", "created_at", "writer")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEDGER_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    job: JobConfig
    step: int
    state: StateManifest
    ledger: _containers.RepeatedCompositeFieldContainer[StepRecord]
    created_at: float
    writer: int
    def __init__(self, job: _Optional[_Union[JobConfig, _Mapping]] = ..., step: _Optional[int] = ..., state: _Optional[_Union[StateManifest, _Mapping]] = ..., ledger: _Optional[_Iterable[_Union[StepRecord, _Mapping]]] = ..., created_at: _Optional[float] = ..., writer: _Optional[int] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("replica", "microbatch_ids")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_IDS_FIELD_NUMBER: _ClassVar[int]
    replica: int
    microbatch_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, replica: _Optional[int] = ..., microbatch_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("step", "generation", "assignments", "reason", "scale_epoch", "open", "version")
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SCALE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    step: int
    generation: int
    assignments: _containers.RepeatedCompositeFieldContainer[Assignment]
    reason: str
    scale_epoch: int
    open: bool
    version: int
    def __init__(self, step: _Optional[int] = ..., generation: _Optional[int] = ..., assignments: _Optional[_Iterable[_Union[Assignment, _Mapping]]] = ..., reason: _Optional[str] = ..., scale_epoch: _Optional[int] = ..., open: _Optional[bool] = ..., version: _Optional[int] = ...) -> None: ...

class ShareUpdate(_message.Message):
    __slots__ = ("generation", "step", "replica", "microbatch_ids", "open", "reason")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_IDS_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    generation: int
    step: int
    replica: int
    microbatch_ids: _containers.RepeatedScalarFieldContainer[int]
    open: bool
    reason: str
    def __init__(self, generation: _Optional[int] = ..., step: _Optional[int] = ..., replica: _Optional[int] = ..., microbatch_ids: _Optional[_Iterable[int]] = ..., open: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("generation", "step", "replica", "steal", "microbatch_ids")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STEAL_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_IDS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    step: int
    replica: int
    steal: int
    microbatch_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, generation: _Optional[int] = ..., step: _Optional[int] = ..., replica: _Optional[int] = ..., steal: _Optional[int] = ..., microbatch_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerationView(_message.Message):
    __slots__ = ("generation", "members", "rendezvous", "plan", "rendezvous_prefix")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_PREFIX_FIELD_NUMBER: _ClassVar[int]
    generation: int
    members: _containers.RepeatedScalarFieldContainer[int]
    rendezvous: str
    plan: Plan
    rendezvous_prefix: str
    def __init__(self, generation: _Optional[int] = ..., members: _Optional[_Iterable[int]] = ..., rendezvous: _Optional[str] = ..., plan: _Optional[_Union[Plan, _Mapping]] = ..., rendezvous_prefix: _Optional[str] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("step", "generation", "next_plan", "final", "microbatches", "tokens", "record", "checkpoint_now")
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NEXT_PLAN_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_NOW_FIELD_NUMBER: _ClassVar[int]
    step: int
    generation: int
    next_plan: Plan
    final: bool
    microbatches: int
    tokens: int
    record: StepRecord
    checkpoint_now: bool
    def __init__(self, step: _Optional[int] = ..., generation: _Optional[int] = ..., next_plan: _Optional[_Union[Plan, _Mapping]] = ..., final: _Optional[bool] = ..., microbatches: _Optional[int] = ..., tokens: _Optional[int] = ..., record: _Optional[_Union[StepRecord, _Mapping]] = ..., checkpoint_now: _Optional[bool] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("reason", "success", "state")
    REASON_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    reason: str
    success: bool
    state: str
    def __init__(self, reason: _Optional[str] = ..., success: _Optional[bool] = ..., state: _Optional[str] = ...) -> None: ...

class WorkloadInfo(_message.Message):
    __slots__ = ("parameters", "gradient_buckets", "samples_per_microbatch", "determinism_sha256", "digest_scheme", "reduce_pieces")
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    DETERMINISM_SHA256_FIELD_NUMBER: _ClassVar[int]
    DIGEST_SCHEME_FIELD_NUMBER: _ClassVar[int]
    REDUCE_PIECES_FIELD_NUMBER: _ClassVar[int]
    parameters: int
    gradient_buckets: _containers.RepeatedScalarFieldContainer[str]
    samples_per_microbatch: int
    determinism_sha256: str
    digest_scheme: str
    reduce_pieces: int
    def __init__(self, parameters: _Optional[int] = ..., gradient_buckets: _Optional[_Iterable[str]] = ..., samples_per_microbatch: _Optional[int] = ..., determinism_sha256: _Optional[str] = ..., digest_scheme: _Optional[str] = ..., reduce_pieces: _Optional[int] = ...) -> None: ...

class Ready(_message.Message):
    __slots__ = ("param_sha256", "pid", "workload", "transfer_address", "transfer_tls_sha256")
    PARAM_SHA256_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    WORKLOAD_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TLS_SHA256_FIELD_NUMBER: _ClassVar[int]
    param_sha256: str
    pid: int
    workload: WorkloadInfo
    transfer_address: str
    transfer_tls_sha256: str
    def __init__(self, param_sha256: _Optional[str] = ..., pid: _Optional[int] = ..., workload: _Optional[_Union[WorkloadInfo, _Mapping]] = ..., transfer_address: _Optional[str] = ..., transfer_tls_sha256: _Optional[str] = ...) -> None: ...

class Donate(_message.Message):
    __slots__ = ("donor", "joiner", "address", "token", "tls_sha256")
    DONOR_FIELD_NUMBER: _ClassVar[int]
    JOINER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TLS_SHA256_FIELD_NUMBER: _ClassVar[int]
    donor: int
    joiner: int
    address: str
    token: str
    tls_sha256: str
    def __init__(self, donor: _Optional[int] = ..., joiner: _Optional[int] = ..., address: _Optional[str] = ..., token: _Optional[str] = ..., tls_sha256: _Optional[str] = ...) -> None: ...

class Join(_message.Message):
    __slots__ = ("joiner", "donor", "token", "attempt")
    JOINER_FIELD_NUMBER: _ClassVar[int]
    DONOR_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    joiner: int
    donor: int
    token: str
    attempt: int
    def __init__(self, joiner: _Optional[int] = ..., donor: _Optional[int] = ..., token: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class JoinProgress(_message.Message):
    __slots__ = ("step", "snapshot_bytes", "snapshot_s", "donor", "attempt", "param_sha256")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_S_FIELD_NUMBER: _ClassVar[int]
    DONOR_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PARAM_SHA256_FIELD_NUMBER: _ClassVar[int]
    step: int
    snapshot_bytes: int
    snapshot_s: float
    donor: int
    attempt: int
    param_sha256: str
    def __init__(self, step: _Optional[int] = ..., snapshot_bytes: _Optional[int] = ..., snapshot_s: _Optional[float] = ..., donor: _Optional[int] = ..., attempt: _Optional[int] = ..., param_sha256: _Optional[str] = ...) -> None: ...

class JoinFailed(_message.Message):
    __slots__ = ("donor", "reason", "attempt", "step")
    DONOR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    donor: int
    reason: str
    attempt: int
    step: int
    def __init__(self, donor: _Optional[int] = ..., reason: _Optional[str] = ..., attempt: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class StopReplica(_message.Message):
    __slots__ = ("replica", "reason")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    replica: int
    reason: str
    def __init__(self, replica: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("dtype", "shape", "nbytes", "shard")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    shard: TensorShard
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., shard: _Optional[_Union[TensorShard, _Mapping]] = ...) -> None: ...

class TensorShard(_message.Message):
    __slots__ = ("global_shape", "dim")
    GLOBAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    global_shape: _containers.RepeatedScalarFieldContainer[int]
    dim: int
    def __init__(self, global_shape: _Optional[_Iterable[int]] = ..., dim: _Optional[int] = ...) -> None: ...

class StateNode(_message.Message):
    __slots__ = ("tensor", "int_value", "float_value", "string_value", "bool_value", "none", "bytes_value", "sequence", "mapping", "int_mapping")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    FLOAT_VALUE_FIELD_NUMBER: _ClassVar[int]
    STRING_VALUE_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    NONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_VALUE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    MAPPING_FIELD_NUMBER: _ClassVar[int]
    INT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    tensor: int
    int_value: int
    float_value: float
    string_value: str
    bool_value: bool
    none: bool
    bytes_value: bytes
    sequence: StateSequence
    mapping: StateMapping
    int_mapping: StateIntMapping
    def __init__(self, tensor: _Optional[int] = ..., int_value: _Optional[int] = ..., float_value: _Optional[float] = ..., string_value: _Optional[str] = ..., bool_value: _Optional[bool] = ..., none: _Optional[bool] = ..., bytes_value: _Optional[bytes] = ..., sequence: _Optional[_Union[StateSequence, _Mapping]] = ..., mapping: _Optional[_Union[StateMapping, _Mapping]] = ..., int_mapping: _Optional[_Union[StateIntMapping, _Mapping]] = ...) -> None: ...

class StateSequence(_message.Message):
    __slots__ = ("items", "tuple")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    TUPLE_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[StateNode]
    tuple: bool
    def __init__(self, items: _Optional[_Iterable[_Union[StateNode, _Mapping]]] = ..., tuple: _Optional[bool] = ...) -> None: ...

class StateMapping(_message.Message):
    __slots__ = ("keys", "values")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    values: _containers.RepeatedCompositeFieldContainer[StateNode]
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., values: _Optional[_Iterable[_Union[StateNode, _Mapping]]] = ...) -> None: ...

class StateIntMapping(_message.Message):
    __slots__ = ("keys", "values")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[int]
    values: _containers.RepeatedCompositeFieldContainer[StateNode]
    def __init__(self, keys: _Optional[_Iterable[int]] = ..., values: _Optional[_Iterable[_Union[StateNode, _Mapping]]] = ...) -> None: ...

class StateManifest(_message.Message):
    __slots__ = ("root", "tensors", "step")
    ROOT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    root: StateNode
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    step: int
    def __init__(self, root: _Optional[_Union[StateNode, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., step: _Optional[int] = ...) -> None: ...

class TransferHello(_message.Message):
    __slots__ = ("token", "donor", "joiner", "stream_key")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONOR_FIELD_NUMBER: _ClassVar[int]
    JOINER_FIELD_NUMBER: _ClassVar[int]
    STREAM_KEY_FIELD_NUMBER: _ClassVar[int]
    token: str
    donor: int
    joiner: int
    stream_key: bytes
    def __init__(self, token: _Optional[str] = ..., donor: _Optional[int] = ..., joiner: _Optional[int] = ..., stream_key: _Optional[bytes] = ...) -> None: ...

class CatchUpStep(_message.Message):
    __slots__ = ("step", "loss", "microbatches", "tokens", "generation", "tensors", "record")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    step: int
    loss: float
    microbatches: int
    tokens: int
    generation: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    record: StepRecord
    def __init__(self, step: _Optional[int] = ..., loss: _Optional[float] = ..., microbatches: _Optional[int] = ..., tokens: _Optional[int] = ..., generation: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., record: _Optional[_Union[StepRecord, _Mapping]] = ...) -> None: ...

class TransferEnd(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Resumed(_message.Message):
    __slots__ = ("generation", "step", "at", "rebuild_s")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    REBUILD_S_FIELD_NUMBER: _ClassVar[int]
    generation: int
    step: int
    at: float
    rebuild_s: float
    def __init__(self, generation: _Optional[int] = ..., step: _Optional[int] = ..., at: _Optional[float] = ..., rebuild_s: _Optional[float] = ...) -> None: ...

class Reduced(_message.Message):
    __slots__ = ("generation", "step", "microbatch_ids", "sample_ids", "loss", "compute_s", "reduce_s", "overflow", "scale_epoch", "tokens", "applied", "lead_s")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    REDUCE_S_FIELD_NUMBER: _ClassVar[int]
    OVERFLOW_FIELD_NUMBER: _ClassVar[int]
    SCALE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    LEAD_S_FIELD_NUMBER: _ClassVar[int]
    generation: int
    step: int
    microbatch_ids: _containers.RepeatedScalarFieldContainer[int]
    sample_ids: _containers.RepeatedScalarFieldContainer[int]
    loss: float
    compute_s: float
    reduce_s: float
    overflow: int
    scale_epoch: int
    tokens: int
    applied: _containers.RepeatedCompositeFieldContainer[Applied]
    lead_s: float
    def __init__(self, generation: _Optional[int] = ..., step: _Optional[int] = ..., microbatch_ids: _Optional[_Iterable[int]] = ..., sample_ids: _Optional[_Iterable[int]] = ..., loss: _Optional[float] = ..., compute_s: _Optional[float] = ..., reduce_s: _Optional[float] = ..., overflow: _Optional[int] = ..., scale_epoch: _Optional[int] = ..., tokens: _Optional[int] = ..., applied: _Optional[_Iterable[_Union[Applied, _Mapping]]] = ..., lead_s: _Optional[float] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("generation", "step", "done", "last_s")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    LAST_S_FIELD_NUMBER: _ClassVar[int]
    generation: int
    step: int
    done: _containers.RepeatedScalarFieldContainer[int]
    last_s: float
    def __init__(self, generation: _Optional[int] = ..., step: _Optional[int] = ..., done: _Optional[_Iterable[int]] = ..., last_s: _Optional[float] = ...) -> None: ...

class Released(_message.Message):
    __slots__ = ("generation", "step", "steal", "microbatch_ids")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEAL_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_IDS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    step: int
    steal: int
    microbatch_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, generation: _Optional[int] = ..., step: _Optional[int] = ..., steal: _Optional[int] = ..., microbatch_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Applied(_message.Message):
    __slots__ = ("step", "param_sha256", "commit_wait_s")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PARAM_SHA256_FIELD_NUMBER: _ClassVar[int]
    COMMIT_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    step: int
    param_sha256: str
    commit_wait_s: float
    def __init__(self, step: _Optional[int] = ..., param_sha256: _Optional[str] = ..., commit_wait_s: _Optional[float] = ...) -> None: ...

class WorkerReport(_message.Message):
    __slots__ = ("replica", "ready", "resumed", "reduced", "applied", "join_progress", "join_failed", "checkpoint_written", "progress", "released")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    REDUCED_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    JOIN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    JOIN_FAILED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    replica: int
    ready: Ready
    resumed: Resumed
    reduced: Reduced
    applied: Applied
    join_progress: JoinProgress
    join_failed: JoinFailed
    checkpoint_written: CheckpointWritten
    progress: Progress
    released: Released
    def __init__(self, replica: _Optional[int] = ..., ready: _Optional[_Union[Ready, _Mapping]] = ..., resumed: _Optional[_Union[Resumed, _Mapping]] = ..., reduced: _Optional[_Union[Reduced, _Mapping]] = ..., applied: _Optional[_Union[Applied, _Mapping]] = ..., join_progress: _Optional[_Union[JoinProgress, _Mapping]] = ..., join_failed: _Optional[_Union[JoinFailed, _Mapping]] = ..., checkpoint_written: _Optional[_Union[CheckpointWritten, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., released: _Optional[_Union[Released, _Mapping]] = ...) -> None: ...

class CheckpointWritten(_message.Message):
    __slots__ = ("step", "path", "bytes", "write_s", "snapshot_s", "error")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITE_S_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    step: int
    path: str
    bytes: int
    write_s: float
    snapshot_s: float
    error: str
    def __init__(self, step: _Optional[int] = ..., path: _Optional[str] = ..., bytes: _Optional[int] = ..., write_s: _Optional[float] = ..., snapshot_s: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class RegisterAgent(_message.Message):
    __slots__ = ("agent_id", "host", "slots", "resume", "replica_ids", "term", "generation", "replica_store_port")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    host: str
    slots: int
    resume: bool
    replica_ids: _containers.RepeatedScalarFieldContainer[int]
    term: int
    generation: int
    replica_store_port: int
    def __init__(self, agent_id: _Optional[str] = ..., host: _Optional[str] = ..., slots: _Optional[int] = ..., resume: _Optional[bool] = ..., replica_ids: _Optional[_Iterable[int]] = ..., term: _Optional[int] = ..., generation: _Optional[int] = ..., replica_store_port: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("sent_at",)
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    sent_at: float
    def __init__(self, sent_at: _Optional[float] = ...) -> None: ...

class FaultNote(_message.Message):
    __slots__ = ("step", "phase", "killed_at")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    KILLED_AT_FIELD_NUMBER: _ClassVar[int]
    step: int
    phase: str
    killed_at: float
    def __init__(self, step: _Optional[int] = ..., phase: _Optional[str] = ..., killed_at: _Optional[float] = ...) -> None: ...

class WorkerError(_message.Message):
    __slots__ = ("where", "step", "microbatch", "message", "traceback", "deterministic")
    WHERE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    where: str
    step: int
    microbatch: int
    message: str
    traceback: str
    deterministic: bool
    def __init__(self, where: _Optional[str] = ..., step: _Optional[int] = ..., microbatch: _Optional[int] = ..., message: _Optional[str] = ..., traceback: _Optional[str] = ..., deterministic: _Optional[bool] = ...) -> None: ...

class WorkerExited(_message.Message):
    __slots__ = ("replica", "exit_code", "signal", "observed_at", "fault", "killed_by_agent", "error", "attached", "output_tail", "status_unknown")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_AT_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    KILLED_BY_AGENT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TAIL_FIELD_NUMBER: _ClassVar[int]
    STATUS_UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    replica: int
    exit_code: int
    signal: int
    observed_at: float
    fault: FaultNote
    killed_by_agent: str
    error: WorkerError
    attached: bool
    output_tail: str
    status_unknown: bool
    def __init__(self, replica: _Optional[int] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., observed_at: _Optional[float] = ..., fault: _Optional[_Union[FaultNote, _Mapping]] = ..., killed_by_agent: _Optional[str] = ..., error: _Optional[_Union[WorkerError, _Mapping]] = ..., attached: _Optional[bool] = ..., output_tail: _Optional[str] = ..., status_unknown: _Optional[bool] = ...) -> None: ...

class ReplicaRequest(_message.Message):
    __slots__ = ("slot", "reason")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    slot: int
    reason: str
    def __init__(self, slot: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("register", "heartbeat", "worker_exited", "report", "replica_request")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    WORKER_EXITED_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_REQUEST_FIELD_NUMBER: _ClassVar[int]
    register: RegisterAgent
    heartbeat: Heartbeat
    worker_exited: WorkerExited
    report: WorkerReport
    replica_request: ReplicaRequest
    def __init__(self, register: _Optional[_Union[RegisterAgent, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., worker_exited: _Optional[_Union[WorkerExited, _Mapping]] = ..., report: _Optional[_Union[WorkerReport, _Mapping]] = ..., replica_request: _Optional[_Union[ReplicaRequest, _Mapping]] = ...) -> None: ...

class ReplicaAssigned(_message.Message):
    __slots__ = ("slot", "replica", "refused", "retryable", "waiting", "first_rank", "replica_store")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    FIRST_RANK_FIELD_NUMBER: _ClassVar[int]
    REPLICA_STORE_FIELD_NUMBER: _ClassVar[int]
    slot: int
    replica: int
    refused: str
    retryable: bool
    waiting: bool
    first_rank: int
    replica_store: str
    def __init__(self, slot: _Optional[int] = ..., replica: _Optional[int] = ..., refused: _Optional[str] = ..., retryable: _Optional[bool] = ..., waiting: _Optional[bool] = ..., first_rank: _Optional[int] = ..., replica_store: _Optional[str] = ...) -> None: ...

class Registered(_message.Message):
    __slots__ = ("replica_ids", "job")
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    replica_ids: _containers.RepeatedScalarFieldContainer[int]
    job: JobConfig
    def __init__(self, replica_ids: _Optional[_Iterable[int]] = ..., job: _Optional[_Union[JobConfig, _Mapping]] = ...) -> None: ...

class ControllerMessage(_message.Message):
    __slots__ = ("registered", "generation", "commit", "shutdown", "heartbeat", "replica_assigned", "donate", "join", "stop_replica", "share", "release", "term")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    DONATE_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    STOP_REPLICA_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    registered: Registered
    generation: GenerationView
    commit: Commit
    shutdown: Shutdown
    heartbeat: Heartbeat
    replica_assigned: ReplicaAssigned
    donate: Donate
    join: Join
    stop_replica: StopReplica
    share: ShareUpdate
    release: Release
    term: int
    def __init__(self, registered: _Optional[_Union[Registered, _Mapping]] = ..., generation: _Optional[_Union[GenerationView, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., replica_assigned: _Optional[_Union[ReplicaAssigned, _Mapping]] = ..., donate: _Optional[_Union[Donate, _Mapping]] = ..., join: _Optional[_Union[Join, _Mapping]] = ..., stop_replica: _Optional[_Union[StopReplica, _Mapping]] = ..., share: _Optional[_Union[ShareUpdate, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ..., term: _Optional[int] = ...) -> None: ...

class RelayedMessage(_message.Message):
    __slots__ = ("agent_id", "message", "closed", "subject", "peer", "reason")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    message: AgentMessage
    closed: bool
    subject: str
    peer: str
    reason: str
    def __init__(self, agent_id: _Optional[str] = ..., message: _Optional[_Union[AgentMessage, _Mapping]] = ..., closed: _Optional[bool] = ..., subject: _Optional[str] = ..., peer: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RelayUp(_message.Message):
    __slots__ = ("relay_id", "messages")
    RELAY_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    relay_id: str
    messages: _containers.RepeatedCompositeFieldContainer[RelayedMessage]
    def __init__(self, relay_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[RelayedMessage, _Mapping]]] = ...) -> None: ...

class RelayDelivery(_message.Message):
    __slots__ = ("agent_ids", "message", "end", "code", "reason")
    AGENT_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    agent_ids: _containers.RepeatedScalarFieldContainer[str]
    message: ControllerMessage
    end: bool
    code: int
    reason: str
    def __init__(self, agent_ids: _Optional[_Iterable[str]] = ..., message: _Optional[_Union[ControllerMessage, _Mapping]] = ..., end: _Optional[bool] = ..., code: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class RelayDown(_message.Message):
    __slots__ = ("deliveries", "term", "agent_timeout_s")
    DELIVERIES_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    AGENT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    deliveries: _containers.RepeatedCompositeFieldContainer[RelayDelivery]
    term: int
    agent_timeout_s: float
    def __init__(self, deliveries: _Optional[_Iterable[_Union[RelayDelivery, _Mapping]]] = ..., term: _Optional[int] = ..., agent_timeout_s: _Optional[float] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("replica", "job")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    replica: int
    job: JobConfig
    def __init__(self, replica: _Optional[int] = ..., job: _Optional[_Union[JobConfig, _Mapping]] = ...) -> None: ...

class WorkerCommand(_message.Message):
    __slots__ = ("welcome", "generation", "commit", "shutdown", "donate", "join", "share", "release")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    DONATE_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    generation: GenerationView
    commit: Commit
    shutdown: Shutdown
    donate: Donate
    join: Join
    share: ShareUpdate
    release: Release
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., generation: _Optional[_Union[GenerationView, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., donate: _Optional[_Union[Donate, _Mapping]] = ..., join: _Optional[_Union[Join, _Mapping]] = ..., share: _Optional[_Union[ShareUpdate, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaderRecord(_message.Message):
    __slots__ = ("term", "address", "controller_id", "elected_at")
    TERM_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_ID_FIELD_NUMBER: _ClassVar[int]
    ELECTED_AT_FIELD_NUMBER: _ClassVar[int]
    term: int
    address: str
    controller_id: str
    elected_at: float
    def __init__(self, term: _Optional[int] = ..., address: _Optional[str] = ..., controller_id: _Optional[str] = ..., elected_at: _Optional[float] = ...) -> None: ...

class AgentRecord(_message.Message):
    __slots__ = ("agent_id", "host", "replica_ids", "join_addresses", "subject", "waiting_slots", "join_tls_sha256", "first_ranks", "peer", "slots", "replica_store_port")
    class JoinAddressesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    class JoinTlsSha256Entry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    class FirstRanksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    JOIN_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    WAITING_SLOTS_FIELD_NUMBER: _ClassVar[int]
    JOIN_TLS_SHA256_FIELD_NUMBER: _ClassVar[int]
    FIRST_RANKS_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    host: str
    replica_ids: _containers.RepeatedScalarFieldContainer[int]
    join_addresses: _containers.ScalarMap[int, str]
    subject: str
    waiting_slots: _containers.RepeatedScalarFieldContainer[int]
    join_tls_sha256: _containers.ScalarMap[int, str]
    first_ranks: _containers.ScalarMap[int, int]
    peer: str
    slots: int
    replica_store_port: int
    def __init__(self, agent_id: _Optional[str] = ..., host: _Optional[str] = ..., replica_ids: _Optional[_Iterable[int]] = ..., join_addresses: _Optional[_Mapping[int, str]] = ..., subject: _Optional[str] = ..., waiting_slots: _Optional[_Iterable[int]] = ..., join_tls_sha256: _Optional[_Mapping[int, str]] = ..., first_ranks: _Optional[_Mapping[int, int]] = ..., peer: _Optional[str] = ..., slots: _Optional[int] = ..., replica_store_port: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaLoad(_message.Message):
    __slots__ = ("replica", "microbatches", "microbatch_s", "lead_s")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_S_FIELD_NUMBER: _ClassVar[int]
    LEAD_S_FIELD_NUMBER: _ClassVar[int]
    replica: int
    microbatches: int
    microbatch_s: float
    lead_s: float
    def __init__(self, replica: _Optional[int] = ..., microbatches: _Optional[int] = ..., microbatch_s: _Optional[float] = ..., lead_s: _Optional[float] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("state", "reason", "generation", "steps_committed", "steps_total", "live_replicas", "load", "recoveries", "last_loss", "tokens", "elapsed_s", "agents", "job_id", "redos", "role", "term", "leader", "joining", "work_stealing", "steals", "microbatches_stolen", "relays", "agents_via_relays")
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEPS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LIVE_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REDOS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    JOINING_FIELD_NUMBER: _ClassVar[int]
    WORK_STEALING_FIELD_NUMBER: _ClassVar[int]
    STEALS_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_STOLEN_FIELD_NUMBER: _ClassVar[int]
    RELAYS_FIELD_NUMBER: _ClassVar[int]
    AGENTS_VIA_RELAYS_FIELD_NUMBER: _ClassVar[int]
    state: str
    reason: str
    generation: int
    steps_committed: int
    steps_total: int
    live_replicas: _containers.RepeatedScalarFieldContainer[int]
    load: _containers.RepeatedCompositeFieldContainer[ReplicaLoad]
    recoveries: int
    last_loss: float
    tokens: int
    elapsed_s: float
    agents: int
    job_id: str
    redos: int
    role: str
    term: int
    leader: str
    joining: _containers.RepeatedScalarFieldContainer[int]
    work_stealing: bool
    steals: int
    microbatches_stolen: int
    relays: int
    agents_via_relays: int
    def __init__(self, state: _Optional[str] = ..., reason: _Optional[str] = ..., generation: _Optional[int] = ..., steps_committed: _Optional[int] = ..., steps_total: _Optional[int] = ..., live_replicas: _Optional[_Iterable[int]] = ..., load: _Optional[_Iterable[_Union[ReplicaLoad, _Mapping]]] = ..., recoveries: _Optional[int] = ..., last_loss: _Optional[float] = ..., tokens: _Optional[int] = ..., elapsed_s: _Optional[float] = ..., agents: _Optional[int] = ..., job_id: _Optional[str] = ..., redos: _Optional[int] = ..., role: _Optional[str] = ..., term: _Optional[int] = ..., leader: _Optional[str] = ..., joining: _Optional[_Iterable[int]] = ..., work_stealing: _Optional[bool] = ..., steals: _Optional[int] = ..., microbatches_stolen: _Optional[int] = ..., relays: _Optional[int] = ..., agents_via_relays: _Optional[int] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ("after_seq",)
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    after_seq: int
    def __init__(self, after_seq: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("seq", "at", "kind", "step", "generation", "replica", "message", "pid")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    seq: int
    at: float
    kind: str
    step: int
    generation: int
    replica: int
    message: str
    pid: int
    def __init__(self, seq: _Optional[int] = ..., at: _Optional[float] = ..., kind: _Optional[str] = ..., step: _Optional[int] = ..., generation: _Optional[int] = ..., replica: _Optional[int] = ..., message: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class EventList(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...

class ReplicaDigest(_message.Message):
    __slots__ = ("replica", "param_sha256")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    PARAM_SHA256_FIELD_NUMBER: _ClassVar[int]
    replica: int
    param_sha256: str
    def __init__(self, replica: _Optional[int] = ..., param_sha256: _Optional[str] = ...) -> None: ...

class StepRecord(_message.Message):
    __slots__ = ("step", "generation", "microbatches", "sample_digest", "loss", "committed_at", "param_sha256", "tokens", "compute_s", "reduce_s", "commit_wait_s", "sample_ids", "replicas", "loads", "failures", "stolen")
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    PARAM_SHA256_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    REDUCE_S_FIELD_NUMBER: _ClassVar[int]
    COMMIT_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    STOLEN_FIELD_NUMBER: _ClassVar[int]
    step: int
    generation: int
    microbatches: int
    sample_digest: str
    loss: float
    committed_at: float
    param_sha256: _containers.RepeatedCompositeFieldContainer[ReplicaDigest]
    tokens: int
    compute_s: float
    reduce_s: float
    commit_wait_s: float
    sample_ids: _containers.RepeatedScalarFieldContainer[int]
    replicas: int
    loads: _containers.RepeatedCompositeFieldContainer[ReplicaLoad]
    failures: _containers.RepeatedCompositeFieldContainer[FailureRecord]
    stolen: int
    def __init__(self, step: _Optional[int] = ..., generation: _Optional[int] = ..., microbatches: _Optional[int] = ..., sample_digest: _Optional[str] = ..., loss: _Optional[float] = ..., committed_at: _Optional[float] = ..., param_sha256: _Optional[_Iterable[_Union[ReplicaDigest, _Mapping]]] = ..., tokens: _Optional[int] = ..., compute_s: _Optional[float] = ..., reduce_s: _Optional[float] = ..., commit_wait_s: _Optional[float] = ..., sample_ids: _Optional[_Iterable[int]] = ..., replicas: _Optional[int] = ..., loads: _Optional[_Iterable[_Union[ReplicaLoad, _Mapping]]] = ..., failures: _Optional[_Iterable[_Union[FailureRecord, _Mapping]]] = ..., stolen: _Optional[int] = ...) -> None: ...

class FailureRecord(_message.Message):
    __slots__ = ("step", "replica", "phase", "cause", "killed_at", "detected_at", "recovered_at", "generation", "error")
    STEP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    KILLED_AT_FIELD_NUMBER: _ClassVar[int]
    DETECTED_AT_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_AT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    step: int
    replica: int
    phase: str
    cause: str
    killed_at: float
    detected_at: float
    recovered_at: float
    generation: int
    error: WorkerError
    def __init__(self, step: _Optional[int] = ..., replica: _Optional[int] = ..., phase: _Optional[str] = ..., cause: _Optional[str] = ..., killed_at: _Optional[float] = ..., detected_at: _Optional[float] = ..., recovered_at: _Optional[float] = ..., generation: _Optional[int] = ..., error: _Optional[_Union[WorkerError, _Mapping]] = ...) -> None: ...

class RecoveryTiming(_message.Message):
    __slots__ = ("detect_s", "plan_s", "rebuild_s", "recompute_s", "commit_s")
    DETECT_S_FIELD_NUMBER: _ClassVar[int]
    PLAN_S_FIELD_NUMBER: _ClassVar[int]
    REBUILD_S_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    COMMIT_S_FIELD_NUMBER: _ClassVar[int]
    detect_s: float
    plan_s: float
    rebuild_s: float
    recompute_s: float
    commit_s: float
    def __init__(self, detect_s: _Optional[float] = ..., plan_s: _Optional[float] = ..., rebuild_s: _Optional[float] = ..., recompute_s: _Optional[float] = ..., commit_s: _Optional[float] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunReport(_message.Message):
    __slots__ = ("job", "status", "steps", "failures", "started_at", "finished_at", "recovery_timings", "workload", "last_checkpoint", "joins")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    WORKLOAD_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    JOINS_FIELD_NUMBER: _ClassVar[int]
    job: JobConfig
    status: JobStatus
    steps: _containers.RepeatedCompositeFieldContainer[StepRecord]
    failures: _containers.RepeatedCompositeFieldContainer[FailureRecord]
    started_at: float
    finished_at: float
    recovery_timings: _containers.RepeatedCompositeFieldContainer[RecoveryTiming]
    workload: WorkloadInfo
    last_checkpoint: CheckpointWritten
    joins: _containers.RepeatedCompositeFieldContainer[JoinInterval]
    def __init__(self, job: _Optional[_Union[JobConfig, _Mapping]] = ..., status: _Optional[_Union[JobStatus, _Mapping]] = ..., steps: _Optional[_Iterable[_Union[StepRecord, _Mapping]]] = ..., failures: _Optional[_Iterable[_Union[FailureRecord, _Mapping]]] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., recovery_timings: _Optional[_Iterable[_Union[RecoveryTiming, _Mapping]]] = ..., workload: _Optional[_Union[WorkloadInfo, _Mapping]] = ..., last_checkpoint: _Optional[_Union[CheckpointWritten, _Mapping]] = ..., joins: _Optional[_Iterable[_Union[JoinInterval, _Mapping]]] = ...) -> None: ...

class JoinInterval(_message.Message):
    __slots__ = ("replica", "started_at", "entered_at", "spare")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENTERED_AT_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    replica: int
    started_at: float
    entered_at: float
    spare: bool
    def __init__(self, replica: _Optional[int] = ..., started_at: _Optional[float] = ..., entered_at: _Optional[float] = ..., spare: _Optional[bool] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("agent_id", "reason")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    reason: str
    def __init__(self, agent_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class SparesRequest(_message.Message):
    __slots__ = ("spares",)
    SPARES_FIELD_NUMBER: _ClassVar[int]
    spares: int
    def __init__(self, spares: _Optional[int] = ...) -> None: ...

class OperatorReply(_message.Message):
    __slots__ = ("accepted", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...
