"""The run's configuration: one typed schema, loaded from and saved to TOML or JSON (``config_file.py``
reads and writes the files).

Every field carries a description right under it (torchtitan's habit); the CLI's help and the app's
form and tooltips are built from the same text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from multilane.engine.config_errors import describe_error, too_deep
from multilane.engine.config_file import merge as merge
from multilane.engine.config_file import read_config_file
from multilane.engine.config_file import save_config as save_config
from multilane.engine.errors import UserError
from multilane.engine.rundir.readfile import user_path
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

MAX_COUNT = 10**12  # steps, intervals: far past any real run, and safe in every int and float type
MAX_DEPTH = 32  # tables and lists nested deeper than this are not a config
CHECKPOINT_MINUTES = 5.0  # the default wall-time cadence; its cost is measured in bench/checkpoint_cost.py
HEALTH_EVERY = 50  # health's default cadence: its cost is measured in bench/health_overhead.py
ACTIVATION_KINDS = ("ReLU", "GELU", "SiLU", "Tanh", "Sigmoid", "LeakyReLU", "ELU", "Softplus", "Mish")


class Section(BaseModel):
    # allow_inf_nan=False: NaN and inf are refused in every float field, with "a finite number".
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _no_nul(cls, value: Any) -> Any:
        if isinstance(value, str) and "\x00" in value:
            raise ValueError("must not contain a NUL character")
        return value


class TaskSection(Section):
    name: str = Field(
        "digits",
        min_length=1,
        description="Built-in task (digits, linear, mlp, charlm, imagefolder, causal-lm) or a path to a .py file",
    )
    params: dict[str, Any] = Field(default_factory=dict, description="The task's own hyperparameters")


class DevicesSection(Section):
    use: str = Field(
        "auto",
        min_length=1,
        description="Devices, one replica each: cuda:0,cuda:1 or cpu:0,cpu:1 (CPU lanes) or auto "
        "(every GPU; without one, two CPU lanes)",
    )
    output: int = Field(0, ge=0, description="Index (in the device list) of the device that gathers the losses")
    weights: list[Annotated[float, Field(ge=0.0, le=1e6)]] = Field(
        default_factory=list,
        description="Share of each batch per device, e.g. [2, 1]; empty splits evenly",
    )
    strategy: Literal["replicate", "persistent", "ddp", "fsdp"] = Field(
        "replicate",
        description="replicate: one process drives every device, copying the model to each at every step, as "
        "nn.DataParallel does (the reference); persistent: one process, one replica per device kept for the whole "
        "run, each device's own backward and gradients summed across devices (no per-step copy: for models with "
        "many modules on GPUs); ddp: one process per device (DistributedDataParallel, NCCL on GPUs, Gloo on CPU), "
        "also across machines; fsdp: one process per device as ddp, the model, its gradients and optimizer state "
        "sharded across them (torch's FSDP2), for models larger than one device. Same results.",
    )
    ddp_backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto",
        description="ddp: the process group's library. auto: NCCL on GPUs, Gloo on CPU lanes and where two "
        "processes share one GPU (cuda:0,cuda:0), which NCCL refuses; gloo also works on GPUs, more slowly",
    )
    collective_timeout_s: float = Field(
        120.0, ge=5.0, le=86_400.0, description="ddp: seconds a rank waits on the others before the run fails"
    )

    sync_batchnorm: bool = Field(
        False,
        description="BatchNorm statistics over the whole batch across devices (not each device's share): "
        "training then equals one device with the whole batch",
    )
    fsdp_activation_checkpointing: bool = Field(
        False,
        description="fsdp: recompute each unit's forward in backward instead of keeping its activations "
        "(less memory, about one more forward of time); units holding BatchNorm are not recomputed",
    )
    fsdp_cpu_offload: bool = Field(
        False,
        description="fsdp: keep the parameter, gradient and optimizer-state shards in host memory (the optimizer "
        "steps on the CPU), copying each unit to the GPU when it computes; on CPU lanes it moves nothing",
    )

    @field_validator("fsdp_activation_checkpointing", "fsdp_cpu_offload", mode="after")
    @classmethod
    def _fsdp_only(cls, value: bool, info: ValidationInfo) -> bool:
        if value and (strategy := info.data.get("strategy", "fsdp")) != "fsdp":
            why = f"an fsdp option, and strategy = {strategy}: use strategy fsdp, or set it false"
            raise ValueError(f"{why} (--set devices.{info.field_name}=false)")
        return value

    @model_validator(mode="after")
    def _weights_sane(self) -> DevicesSection:
        if self.weights and (any(w < 0 for w in self.weights) or sum(self.weights) <= 0):
            raise ValueError("weights must be >= 0 and not all 0")
        if self.ddp_backend == "nccl" and "cpu" in self.use.lower():
            raise ValueError(f"ddp_backend nccl needs GPUs, and use = {self.use!r} lists CPU lanes; use gloo or auto")
        return self


PROCESS_STRATEGIES = ("ddp", "fsdp")
"""The strategies that run one process per device (through the ddp launcher)."""


class DataSection(Section):
    batch_size: int = Field(64, ge=1, le=1_000_000, description="Samples per step, split across the devices")
    val_fraction: float = Field(0.2, ge=0.0, lt=1.0, description="Fraction of the data held out for validation")
    workers: int | None = Field(
        None,
        ge=0,
        le=64,
        description="DataLoader worker processes reading a Dataset task's samples (0: in the training "
        "process); auto: one per core but one, at most 8. In-memory ArrayData needs none",
        json_schema_extra={"none_text": "auto"},
    )
    prefetch: int = Field(2, ge=1, le=64, description="Batches each DataLoader worker prepares ahead")


class OptimSection(Section):
    name: Literal["sgd", "adam", "adamw"] = Field("adam", description="Optimizer")
    lr: float = Field(3e-3, gt=0.0, le=10.0, description="Peak learning rate")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="SGD momentum")
    nesterov: bool = Field(False, description="SGD Nesterov momentum")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="Weight decay (decoupled for adamw)")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="Adam/AdamW beta1")
    beta2: float = Field(0.999, ge=0.0, lt=1.0, description="Adam/AdamW beta2")

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> OptimSection:
        if self.name == "sgd" and self.nesterov and self.momentum == 0:
            raise ValueError("nesterov needs momentum > 0")
        return self


class ScheduleSection(Section):
    kind: Literal["constant", "cosine", "step"] = Field("constant", description="Learning-rate schedule")
    warmup_steps: int = Field(0, ge=0, le=MAX_COUNT, description="Linear warmup from 0 to lr over this many steps")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Cosine: final lr as a fraction of lr")
    step_size: int = Field(
        100, ge=1, le=MAX_COUNT, description="Step schedule: multiply lr by gamma every this many steps"
    )
    gamma: float = Field(0.5, gt=0.0, le=1.0, description="Step schedule: factor applied every step_size steps")


class TrainSection(Section):
    epochs: int = Field(5, ge=1, le=100_000, description="Passes over the training data (unless steps is set)")
    steps: int | None = Field(None, ge=1, le=MAX_COUNT, description="Optimizer steps to run; overrides epochs when set")
    grad_accum: int = Field(1, ge=1, le=1024, description="Micro-batches accumulated per optimizer step")
    grad_clip: float = Field(0.0, ge=0.0, le=1e12, description="Clip the gradient norm to this value; 0 turns it off")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="fp32, or mixed precision (autocast in each replica) with bf16 or fp16"
    )
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed for the model, the split and the data order")
    log_every: int = Field(
        10, ge=1, le=MAX_COUNT, description="Read metrics from the devices every N steps (a device sync)"
    )
    eval_every: int = Field(
        50, ge=0, le=MAX_COUNT, description="Evaluate on the validation set every N steps; 0: at the end only"
    )
    checkpoint_every: int = Field(
        0, ge=0, le=MAX_COUNT, description="Save a checkpoint every N steps; 0: by time only (and at the end or a stop)"
    )
    checkpoint_minutes: float = Field(
        CHECKPOINT_MINUTES,
        ge=0.0,
        le=1e6,
        description="Also save a checkpoint when this many minutes have passed since the last one, so that a "
        "crash loses at most that much work; 0 turns it off",
    )
    on_nonfinite: Literal["stop", "pause"] = Field(
        "stop",
        description="What to do when the loss (or the weights) becomes NaN or inf: stop (the run ends "
        '"diverged", its last checkpoint the last finite state) or pause first',
    )
    fit_check: bool = Field(
        True,
        description="Before training, measure the memory the run will need (a probe step at two small batches) "
        "and refuse a run that will not fit, naming the largest batch that would",
    )
    tensorboard: bool = Field(
        False,
        description="Also write TensorBoard event files into the run folder (losses per device, validation, lr, "
        "utilization): tensorboard --logdir runs/ shows the run. Needs the tensorboard extra",
    )


class TelemetrySection(Section):
    enabled: bool = Field(True, description="Sample device utilization, memory, temperature and power during the run")
    rate_hz: float = Field(5.0, ge=0.2, le=50.0, description="Samples per second (NVML utilization spans 1/6 s to 1 s)")
    record_s: float = Field(
        1.0, ge=0.1, le=60.0, description="Seconds per telemetry record (mean/min/max of its samples)"
    )


class HealthSection(Section):
    enabled: bool = Field(
        True,
        description="Sample the run's health: per-layer gradient, weight and update norms, activations, and "
        "(on two or more devices) the gradient noise scale",
    )
    every: int = Field(
        HEALTH_EVERY,
        ge=1,
        le=MAX_COUNT,
        description="Sample health every N optimizer steps (the default keeps its cost within 2 % of step time)",
    )
    activations: str = Field(
        ",".join(ACTIVATION_KINDS),
        max_length=2000,
        pattern=r"^[A-Za-z0-9_, ]*$",
        description="Module kinds (class names, comma-separated) whose outputs get mean, std and fraction of "
        "exact zeros; empty: none",
    )
    groups: int = Field(
        24, ge=1, le=4096, description="At most this many rows shown per quantity: deeper models are grouped by block"
    )
    nan_replay: bool = Field(
        True,
        description="Keep the state before each log window, so that a loss gone NaN or inf is replayed to "
        "name the first module, parameter, device and samples that went non-finite",
    )
    noise_decay: float = Field(
        0.9, ge=0.0, lt=1.0, description="Smoothing of the noise-scale estimates (per sample: EMA decay)"
    )


class TrackingSection(Section):
    mlflow: str | None = Field(
        None,
        max_length=2048,
        description="MLflow tracking server to log the run to, live (http://host:5000, https://…): params, tags, "
        "losses per device, validation, telemetry and, at the end, config.json, metrics.jsonl and the loss figure. "
        "Never slows training: a server that is down gets one warning, and multilane export RUN --mlflow URI sends "
        "the rest. Credentials from MLFLOW_TRACKING_USERNAME/PASSWORD/TOKEN. Needs the mlflow extra",
    )
    experiment: str = Field(
        "multilane",
        min_length=1,
        max_length=256,
        description="MLflow experiment the run is logged under (created when the server lacks it)",
    )

    @field_validator("mlflow")
    @classmethod
    def _no_credentials(cls, v: str | None) -> str | None:
        """Blank is off. A user or password in the URI would be written into config.json, checkpoints and
        the server's params: refused, naming MLflow's own variables for them."""
        v = v.strip() or None if v is not None else None
        if v is not None and "@" in v.split("://", 1)[-1].split("/", 1)[0]:
            raise ValueError(
                "a user or password in the URI would be saved with the run; "
                "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) instead"
            )
        return v


class RunSection(Section):
    name: str = Field("run", min_length=1, max_length=80, pattern=r"^[A-Za-z0-9._-]+$", description="Run name")
    runs_dir: str = Field("runs", min_length=1, description="Folder that holds one folder per run")

    @field_validator("runs_dir")
    @classmethod
    def _a_usable_path(cls, v: str) -> str:  # ~nosuchuser, a 300-byte name: refused before any folder is made
        try:
            user_path(v, "runs_dir")
        except UserError as e:
            raise ValueError(str(e).removeprefix("runs_dir: ")) from None
        return v


class RunConfig(Section):
    """Everything a run needs; its JSON form is saved inside every run directory and checkpoint."""

    task: TaskSection = Field(default_factory=TaskSection)
    devices: DevicesSection = Field(default_factory=DevicesSection)
    data: DataSection = Field(default_factory=DataSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    schedule: ScheduleSection = Field(default_factory=ScheduleSection)
    train: TrainSection = Field(default_factory=TrainSection)
    telemetry: TelemetrySection = Field(default_factory=TelemetrySection)
    health: HealthSection = Field(default_factory=HealthSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    run: RunSection = Field(default_factory=RunSection)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def is_task_file(name: str) -> bool:
    """Whether a task name is the path of the user's own .py file (else a built-in task's name)."""
    return name.endswith(".py") or "/" in name or "\\" in name


def check_task_file(path: str | Path) -> Path:
    """The task file's path; one line where it is not there, checked before torch is imported (seconds
    under load) as well as by the loader."""
    p = user_path(path, "task file")
    try:
        if not p.exists():
            raise UserError(f"task file {p}: no such file")
        if not p.is_file():
            raise UserError(f"task file {p}: not a file")
    except ValueError as e:  # an embedded NUL
        raise UserError(f"task file {str(path)!r}: not a usable path ({e})") from None
    return p


def build_config(data: dict[str, Any], source: str = "config") -> RunConfig:
    """Validate a plain dict into a RunConfig, or raise UserError with one clear line."""
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a table of sections, got {type(data).__name__}")
    deep = too_deep(data, MAX_DEPTH)
    if deep:
        raise UserError(f"{source}: {deep}: nested more than {MAX_DEPTH} levels deep")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise UserError(f"{source}: {describe_error(e, model=RunConfig)}") from None


def load_config(path: str | Path) -> RunConfig:
    return build_config(read_config_file(path), str(path))
