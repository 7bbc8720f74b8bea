"""The InferenceService spec: tiers of models, how each is served, routed and scaled.

Every cross-field rule is written twice on purpose, from one message: as a CEL rule the API
server enforces at ``kubectl apply``, and as a Python validator so ``fleetpilot plan`` and the
local runtime refuse exactly the same objects with exactly the same words.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from itertools import pairwise
from typing import Annotated, Literal, Self

from pydantic import Field, StringConstraints, model_validator

from fleetpilot.api.base import ApiModel, cel_rules, nested
from fleetpilot.api.pod_template import PodTemplateOverlay, combine
from fleetpilot.api.units import Duration, PositiveQuantity, Quantity

# A DNS-1035 label: usable in Service names and as a label value.
DNS_LABEL_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DnsLabel = Annotated[str, StringConstraints(pattern=DNS_LABEL_PATTERN, max_length=63)]

# The pinned engine release. Never `latest`: a rollout must be a spec change, not a pull. The
# pyproject's `vllm` extra (the contract tests' judge) and the engine Dockerfile pin the same
# release; tests hold them to this constant.
VLLM_VERSION = "0.33.0"
DEFAULT_VLLM_IMAGE = f"vllm/vllm-openai:v{VLLM_VERSION}"
MAX_TIERS = 8
MAX_TENANTS = 64
MAX_GPUS_PER_ENGINE = 64


class Rule:
    """Messages of the cross-field rules, shared by the CEL rules and the Python validators."""

    REPLICAS_ORDER = "replicas.min must be less than or equal to replicas.max"
    REPLICAS_INITIAL = "replicas.initial must lie within replicas.min..replicas.max"
    GPUS_PER_ENGINE = (
        "parallelism.tensor x parallelism.pipeline (GPUs per engine instance) must be within 1..64"
    )
    DATA_LOCAL_DIVIDES = (
        "parallelism.dataLocal (data-parallel ranks per node) must divide parallelism.data"
    )
    EXPERT_NEEDS_RANKS = (
        "parallelism.expert needs parallelism.data x parallelism.tensor > 1: experts are "
        "spread over the data-parallel and tensor-parallel ranks"
    )
    EPLB_NEEDS_EXPERT = "parallelism.eplb needs parallelism.expert"
    DISAGG_NEEDS_ROLES = "serving.mode disaggregated needs both serving.prefill and serving.decode"
    UNIFIED_NO_ROLES = (
        "serving.prefill and serving.decode are only allowed when serving.mode is disaggregated"
    )
    DISAGG_NO_REPLICAS = (
        "serving.replicas applies to unified mode only; with serving.mode disaggregated set "
        "serving.prefill.replicas and serving.decode.replicas"
    )
    KV_TRANSFER_DISAGG_ONLY = (
        "serving.kvTransfer is only allowed when serving.mode is disaggregated"
    )
    SPEC_MODEL_REQUIRED = "speculative.model is required for methods eagle, eagle3 and draft_model"
    SPEC_MODEL_FORBIDDEN = "speculative.model is only used by methods eagle, eagle3 and draft_model"
    BATCHED_TOKENS = "engine.maxNumBatchedTokens must be at least engine.maxNumSeqs"
    KV_OFFLOAD_LMCACHE = (
        "engine.kvOffload.backend lmcache is not supported: vLLM's lmcache backend ignores "
        "engine.kvOffload.size and needs an LMCache server at tcp://localhost:5555 that "
        "fleetpilot does not deploy; use native"
    )
    KV_OFFLOAD_UNIFIED_ONLY = (
        "engine.kvOffload is only allowed when serving.mode is unified: vLLM replaces the "
        "P/D KV connector (serving.kvTransfer) with its offloading connector"
    )
    SOURCE_ONE_OF = "model.source takes at most one of huggingface, pvc, oci and s3"
    CACHE_SIZE_OR_CLAIM = "modelCache takes exactly one of size (a new claim) and claimName"
    TIER_NAMES_UNIQUE = "spec.tiers[].name must be unique"
    COMPLEXITY_INCREASING = (
        "spec.tiers[].complexity.upTo must increase strictly from tier to tier (cheapest first)"
    )
    SCALE_DOWN_WINDOW = (
        "autoscaling.scaleDown.stabilization must be at least autoscaling.scaleUp.stabilization"
    )
    ADAPTER_SOURCE_ONE_OF = "an adapter's source takes exactly one of pvc and huggingface"
    LORA_CPU_LORAS = "lora.maxCpuLoras must be at least lora.maxLoras"
    ADAPTER_BASE_MODEL = (
        "spec.tiers[].adapters[].baseModel, when set, must be the tier's model.name"
    )
    ADAPTER_NAMES_UNIQUE = "spec.tiers[].adapters[].name must be unique in the service"
    ADAPTER_NOT_A_MODEL = (
        "spec.tiers[].adapters[].name must differ from the name every tier's model is "
        "requested by (model.servedName, else model.name)"
    )
    TENANT_NAMES_UNIQUE = "spec.routing.auth.tenants[].name must be unique"
    GATEWAY_FAIL_OPEN_AUTH = (
        "routing.gateway.failureMode FailOpen lets the gateway send requests past "
        "routing.auth's API keys whenever no router answers it: use FailClose with auth"
    )
    GATEWAY_FAIL_OPEN_TIERS = (
        "routing.gateway.failureMode FailOpen sends a request to any engine of the pool, "
        "whatever tier its model names: only a service of one tier can fail open"
    )
    NAME_LABEL = (
        "metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', starting "
        "with a letter) of at most 63 characters: it names the Services and labels of the fleet"
    )


class ReplicaBounds(ApiModel):
    """How many engine replicas a role may run; the autoscaler moves within these bounds."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel_rules(
            ("self.min <= self.max", Rule.REPLICAS_ORDER),
            (
                "!has(self.initial) || (self.initial >= self.min && self.initial <= self.max)",
                Rule.REPLICAS_INITIAL,
            ),
        )
    }

    min: int = Field(1, ge=0, le=1000, description="Fewest replicas; 0 allows scale to zero.")
    max: int = Field(1, ge=1, le=1000, description="Most replicas the autoscaler may run.")
    initial: int | None = Field(
        None,
        ge=0,
        le=1000,
        description="Replicas when the Deployment is first created (default: max(min, 1)).",
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.min > self.max:
            raise ValueError(Rule.REPLICAS_ORDER)
        if self.initial is not None and not self.min <= self.initial <= self.max:
            raise ValueError(Rule.REPLICAS_INITIAL)
        return self

    @property
    def start(self) -> int:
        """Replicas to create with: ``initial``, else at least one so the tier can serve."""
        if self.initial is not None:
            return self.initial
        return min(max(self.min, 1), self.max)


class SecretKeyRef(ApiModel):
    """A key of a Secret in the service's namespace. Secrets never appear in specs or logs."""

    name: DnsLabel = Field(description="Secret name.")
    key: str = Field("token", min_length=1, max_length=253, description="Key within the Secret.")


class SecretRef(ApiModel):
    """A Secret in the service's namespace, by name; the keys it must hold are the field's."""

    name: DnsLabel = Field(description="Secret name.")


class HuggingFaceSource(ApiModel):
    """Weights downloaded from the Hugging Face Hub (or a mirror): by the engine at start, or
    once by the model cache's Job (spec.modelCache)."""

    revision: str | None = Field(
        None, max_length=128, description="Branch, tag or commit of the model repository."
    )
    token_secret_ref: SecretKeyRef | None = Field(
        None, description="Secret key holding a Hub token, for gated or private models."
    )
    endpoint: str | None = Field(
        None,
        max_length=2048,
        pattern=r"^https?://",
        description="Hub endpoint (a private mirror: Artifactory, hf-mirror...); huggingface.co "
        "when unset. Given to the download (the model cache's Job, or a vLLM engine that "
        "downloads at start) as HF_ENDPOINT.",
    )


class PvcSource(ApiModel):
    """Weights already on a PersistentVolumeClaim (mounted read-only at /models)."""

    claim_name: str = Field(min_length=1, max_length=253, description="PVC name.")
    sub_path: str | None = Field(
        None,
        max_length=1024,
        description="Directory of the model inside the volume (default: the model name).",
    )


class OciMount(StrEnum):
    AUTO = "auto"
    IMAGE_VOLUME = "imageVolume"
    COPY = "copy"


class PullPolicy(StrEnum):
    ALWAYS = "Always"
    IF_NOT_PRESENT = "IfNotPresent"
    NEVER = "Never"


class OciSource(ApiModel):
    """Weights carried in an OCI image (a "modelcar"), pulled by the kubelet like any image."""

    image: str = Field(
        min_length=1,
        max_length=1024,
        pattern=r"^[^\s]+$",
        description="Image reference; pin a digest (repo@sha256:...) for reproducible weights.",
    )
    path: str = Field(
        "/models",
        max_length=1024,
        # Absolute, and no '.' or '..' component: a directory of the image.
        pattern=r"^(/\.?[A-Za-z0-9_-][A-Za-z0-9._-]*)+$",
        description="Directory of the model inside the image.",
    )
    pull_policy: PullPolicy = Field(PullPolicy.IF_NOT_PRESENT, description="Image pull policy.")
    mount: OciMount = Field(
        OciMount.AUTO,
        description="imageVolume mounts the image read-only (Kubernetes >= 1.35 and a runtime "
        "that supports it); copy copies the directory into the pod with an init container "
        "running the image's own `cp`; auto picks imageVolume on API servers >= 1.35.",
    )


class S3Source(ApiModel):
    """Weights in S3-compatible object storage, downloaded before the engine starts."""

    endpoint: str | None = Field(
        None,
        max_length=2048,
        pattern=r"^https?://",
        description="Endpoint URL (MinIO, Ceph, GCS's XML API...); AWS when unset.",
    )
    bucket: str = Field(min_length=3, max_length=63, description="Bucket name.")
    prefix: str = Field(
        "",
        max_length=1024,
        description="Key prefix of the model's objects (the model is the objects under it).",
    )
    region: str | None = Field(None, min_length=1, max_length=64, description="Region.")
    credentials_secret_ref: SecretRef | None = Field(
        None,
        description="Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and optionally "
        "AWS_SESSION_TOKEN); unset: the pod's own identity (IRSA, workload identity).",
    )


class ModelSource(ApiModel):
    """Where the engine reads weights from: at most one source; the Hugging Face Hub when none
    is set."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel_rules(
            (
                "[has(self.huggingface), has(self.pvc), has(self.oci), has(self.s3)]"
                ".filter(x, x).size() <= 1",
                Rule.SOURCE_ONE_OF,
            )
        )
    }

    pvc: PvcSource | None = Field(None, description="Read weights from a PVC.")
    huggingface: HuggingFaceSource | None = Field(
        None, description="Download weights from the Hugging Face Hub."
    )
    oci: OciSource | None = Field(None, description="Read weights from an OCI image.")
    s3: S3Source | None = Field(None, description="Download weights from object storage.")

    @model_validator(mode="after")
    def _check(self) -> Self:
        given = (self.pvc, self.huggingface, self.oci, self.s3)
        if sum(source is not None for source in given) > 1:
            raise ValueError(Rule.SOURCE_ONE_OF)
        return self

    @property
    def from_hub(self) -> bool:
        """The Hub is the source: named, or by default."""
        return self.pvc is None and self.oci is None and self.s3 is None


class Quantization(StrEnum):
    AWQ = "awq"
    AWQ_MARLIN = "awq_marlin"
    GPTQ = "gptq"
    GPTQ_MARLIN = "gptq_marlin"
    FP8 = "fp8"
    BITSANDBYTES = "bitsandbytes"
    COMPRESSED_TENSORS = "compressed-tensors"
    GGUF = "gguf"
    MODELOPT = "modelopt"


class ModelDtype(StrEnum):
    AUTO = "auto"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"


class ModelArchitecture(ApiModel):
    """The shape of the model, for sizing its KV cache and weights (the planner knows common
    models by name; set this for others)."""

    layers: int = Field(ge=1, le=1024, description="Transformer layers (num_hidden_layers).")
    kv_heads: int = Field(
        ge=1, le=1024, description="Key/value heads per layer (num_key_value_heads)."
    )
    head_dim: int = Field(ge=1, le=4096, description="Dimension of one attention head.")
    parameters: int | None = Field(
        None, ge=1, description="Parameters of the checkpoint (all experts of a MoE model)."
    )
    expert_parameters: int | None = Field(
        None,
        ge=1,
        description="Of those, the routed experts' (a MoE model): with parallelism.expert they "
        "are spread over the data x tensor ranks, the rest split by tensor x pipeline.",
    )
    kv_lora_rank: int | None = Field(
        None,
        ge=1,
        le=65536,
        description="Multi-head latent attention (DeepSeek-V2/V3): rank of the cached latent.",
    )
    qk_rope_head_dim: int | None = Field(
        None, ge=0, le=4096, description="Multi-head latent attention: rotary part cached too."
    )


class ModelSpec(ApiModel):
    """The model a tier serves."""

    name: str = Field(
        min_length=1,
        max_length=256,
        description="Model id on the Hub (e.g. Qwen/Qwen2.5-7B-Instruct) or directory name.",
    )
    served_name: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$",
        description="Name clients use in the `model` field (default: the model name).",
    )
    max_model_len: int | None = Field(
        None, ge=16, le=4_194_304, description="Context length in tokens (default: the model's)."
    )
    quantization: Quantization | None = Field(
        None, description="Weight quantization method of the checkpoint."
    )
    dtype: ModelDtype = Field(ModelDtype.AUTO, description="Activation/weight dtype.")
    source: ModelSource = nested(ModelSource, "Where the weights come from.")
    architecture: ModelArchitecture | None = Field(
        None,
        description="Shape of the model for capacity planning (common models are known by name).",
    )

    @property
    def alias(self) -> str:
        """The name clients request this model by."""
        return self.served_name or self.name


class KvCacheDtype(StrEnum):
    AUTO = "auto"
    FP8 = "fp8"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"


class KvCache(ApiModel):
    """Paged KV cache settings."""

    block_size: int = Field(
        16, description="Tokens per KV block.", json_schema_extra={"enum": [8, 16, 32, 64, 128]}
    )
    dtype: KvCacheDtype = Field(KvCacheDtype.AUTO, description="KV cache element type.")
    prefix_caching: bool = Field(True, description="Share KV blocks of identical prompt prefixes.")

    @model_validator(mode="after")
    def _check_block(self) -> Self:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError("kvCache.blockSize must be one of 8, 16, 32, 64, 128")
        return self


class SpeculativeMethod(StrEnum):
    NGRAM = "ngram"
    EAGLE = "eagle"
    EAGLE3 = "eagle3"
    DRAFT_MODEL = "draft_model"
    MTP = "mtp"
    SUFFIX = "suffix"


_METHODS_WITH_MODEL = ("eagle", "eagle3", "draft_model")


class Speculative(ApiModel):
    """Speculative decoding: a cheap proposer drafts tokens the target model verifies."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel_rules(
            (
                "!(self.method in ['eagle', 'eagle3', 'draft_model']) || has(self.model)",
                Rule.SPEC_MODEL_REQUIRED,
            ),
            (
                "self.method in ['eagle', 'eagle3', 'draft_model'] || !has(self.model)",
                Rule.SPEC_MODEL_FORBIDDEN,
            ),
        )
    }

    method: SpeculativeMethod = Field(description="Proposer.")
    model: str | None = Field(
        None, min_length=1, max_length=256, description="Draft/EAGLE model id."
    )
    num_tokens: int = Field(5, ge=1, le=16, description="Tokens proposed per step.")
    prompt_lookup_max: int | None = Field(
        None, ge=1, le=16, description="ngram: longest n-gram matched against the prompt."
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        needs_model = self.method.value in _METHODS_WITH_MODEL
        if needs_model and self.model is None:
            raise ValueError(Rule.SPEC_MODEL_REQUIRED)
        if not needs_model and self.model is not None:
            raise ValueError(Rule.SPEC_MODEL_FORBIDDEN)
        return self


class EnvVar(ApiModel):
    """A plain environment variable for the engine container (no secrets: use a Secret ref)."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=128)
    value: str = Field("", max_length=4096)


class EngineBackend(StrEnum):
    VLLM = "vllm"
    REFERENCE = "reference"


class ReferenceModel(StrEnum):
    """The reference engine's model presets (its ``--model-config``): seeded random Llama-style
    models small enough for a CPU, built at start, never downloaded."""

    TINY = "tiny"  # 3 layers x 64 wide, up to 2048 tokens: answers in milliseconds
    SMALL = "small"  # 4 layers x 128 wide, up to 4096 tokens: the engine's default


class KvOffloadBackend(StrEnum):
    NATIVE = "native"
    LMCACHE = "lmcache"


class KvOffload(ApiModel):
    """A second tier of KV cache in the engine host's memory (vLLM's ``--kv-offloading-size``
    and ``--kv-offloading-backend``): the KV blocks of prompts are copied to host memory as
    they are computed, and copied back when a later prompt's prefix is found there but no
    longer on the GPUs, which is cheaper than computing it again. The engine pod's memory
    request and limit grow by ``size`` and a margin, and its /dev/shm (where vLLM maps the host
    tier) by ``size``."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel_rules(
            ("!has(self.backend) || self.backend != 'lmcache'", Rule.KV_OFFLOAD_LMCACHE)
        )
    }

    size: PositiveQuantity = Field(
        description="Host memory for offloaded KV blocks of one engine (e.g. 64Gi): of a "
        "replica, or with parallelism.data above 1 of each of its data-parallel ranks (each "
        "rank is an engine with a cache of its own); the total over the engine's tensor x "
        "pipeline GPUs, as vLLM's --kv-offloading-size means it. Set it above the GPUs' KV "
        "cache: the host tier holds copies of the blocks on the GPUs too.",
    )
    backend: KvOffloadBackend = Field(
        KvOffloadBackend.NATIVE,
        description="native: vLLM's own CPU offloading (its OffloadingConnector). lmcache is "
        "refused: vLLM's lmcache backend ignores size and talks to an LMCache server at "
        "tcp://localhost:5555, which fleetpilot does not deploy.",
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.backend is KvOffloadBackend.LMCACHE:
            raise ValueError(Rule.KV_OFFLOAD_LMCACHE)
        return self


class EngineSettings(ApiModel):
    """How the engine (vLLM, or the CPU reference engine) runs the model."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel_rules(
            (
                "!has(self.maxNumBatchedTokens) || self.maxNumBatchedTokens >= self.maxNumSeqs",
                Rule.BATCHED_TOKENS,
            )
        )
    }

    backend: EngineBackend = Field(
        EngineBackend.VLLM,
        description=(
            "vllm: vLLM on GPUs (production). reference: fleetpilot's CPU reference engine "
            "from the fleetpilot reference image (the operator's --reference-image), a small "
            "seeded random model (referenceModel) with real paged KV, prefix caching, KV "
            "events and the P/D hand-off, on no GPU: for trying fleetpilot on a GPU-less "
            "cluster such as kind, and for CI checks of GitOps pipelines; never for real "
            "weights. It may instead read a checkpoint of its own format (config.json and "
            "model.safetensors) from the Hub: model.source.huggingface with spec.modelCache "
            "(the cache's Job downloads it once; the engines read it offline). With reference "
            "the planner ignores image, gpuMemoryUtilization and resources, sizes the pods' "
            "CPU and memory itself (no GPU), and refuses what the engine cannot run: "
            "parallelism above 1, maxModelLen above the preset's, a pvc, oci or s3 model "
            "source, a Hub source without spec.modelCache, quantization, a dtype or KV cache "
            "dtype other than auto, speculative decoding, LoRA adapters and extraArgs."
        ),
    )
    reference_model: ReferenceModel = Field(
        ReferenceModel.TINY,
        description=(
            "backend reference only: the random model's preset. tiny (up to 2048 tokens) "
            "answers in milliseconds; small (up to 4096 tokens) is four times the compute. "
            "Ignored with a checkpoint (model.source.huggingface): its config.json wins."
        ),
    )
    image: str = Field(
        DEFAULT_VLLM_IMAGE,
        min_length=1,
        max_length=512,
        pattern=r"^[^\s]+$",
        description="Engine container image (backend vllm); pin a release, never `latest`.",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=0.99, description="Share of each GPU's memory vLLM may use."
    )
    max_num_seqs: int = Field(256, ge=1, le=4096, description="Most sequences in one batch.")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, le=1_048_576, description="Token budget of one scheduler step."
    )
    kv_cache: KvCache = nested(KvCache, "Paged KV cache.")
    kv_offload: KvOffload | None = Field(
        None,
        description="A second KV-cache tier in host memory (unified serving only: vLLM's "
        "offloading connector would replace the P/D one); unset: the GPUs' cache only.",
    )
    speculative: Speculative | None = Field(None, description="Speculative decoding.")
    extra_args: list[Annotated[str, StringConstraints(max_length=512)]] = Field(
        default_factory=list,
        max_length=64,
        description="Extra `vllm serve` arguments, appended last.",
    )
    env: list[EnvVar] = Field(
        default_factory=list, max_length=64, description="Extra environment variables."
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if (
            self.max_num_batched_tokens is not None
            and self.max_num_batched_tokens < self.max_num_seqs
        ):
            raise ValueError(Rule.BATCHED_TOKENS)
        return self


class Eplb(ApiModel):
    """vLLM's expert-parallel load balancer: it records how busy each expert is and moves
    (and replicates) hot experts between ranks, so one rank's experts do not set the pace."""

    redundant_experts: int = Field(
        0, ge=0, le=4096, description="Extra replicas of hot experts, spread over the ranks."
    )
    window_size: int | None = Field(
        None, ge=1, description="Engine steps of expert load recorded (vLLM's default: 1000)."
    )
    step_interval: int | None = Field(
        None, ge=1, description="Engine steps between rearrangements (vLLM's default: 3000)."
    )


class Parallelism(ApiModel):
    """How one replica splits the model over GPUs, and over nodes when it needs more GPUs
    than one node has (a multi-node replica: a LeaderWorkerSet group)."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel_rules(
            ("self.tensor * self.pipeline <= 64", Rule.GPUS_PER_ENGINE),
            ("!has(self.dataLocal) || self.data % self.dataLocal == 0", Rule.DATA_LOCAL_DIVIDES),
            ("!self.expert || self.data * self.tensor > 1", Rule.EXPERT_NEEDS_RANKS),
            ("!has(self.eplb) || self.expert", Rule.EPLB_NEEDS_EXPERT),
        )
    }

    tensor: int = Field(1, ge=1, le=64, description="Tensor-parallel degree.")
    pipeline: int = Field(1, ge=1, le=64, description="Pipeline-parallel degree.")
    data: int = Field(
        1, ge=1, le=64, description="Data-parallel ranks served by one replica (one endpoint)."
    )
    data_local: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Data-parallel ranks per node when a replica's ranks span nodes (default: "
        "as many as fit on resources.gpusPerNode).",
    )
    expert: bool = Field(
        False,
        description="Expert parallelism for a mixture-of-experts model: experts are spread "
        "over the data x tensor ranks instead of being split by tensor parallelism.",
    )
    eplb: Eplb | None = Field(None, description="Expert load balancing (needs expert); unset: off.")

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.tensor * self.pipeline > MAX_GPUS_PER_ENGINE:
            raise ValueError(Rule.GPUS_PER_ENGINE)
        if self.data_local is not None and self.data % self.data_local:
            raise ValueError(Rule.DATA_LOCAL_DIVIDES)
        if self.expert and self.data * self.tensor <= 1:
            raise ValueError(Rule.EXPERT_NEEDS_RANKS)
        if self.eplb is not None and not self.expert:
            raise ValueError(Rule.EPLB_NEEDS_EXPERT)
        return self

    @property
    def gpus(self) -> int:
        """GPUs one replica needs: every data-parallel rank holds a tensor x pipeline group."""
        return self.tensor * self.pipeline * self.data


class Resources(ApiModel):
    """What an engine pod asks of its node, besides GPUs."""

    gpu_product: str | None = Field(
        None,
        max_length=63,
        pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
        description="Value of the node label nvidia.com/gpu.product to schedule onto.",
    )
    gpu_resource: str = Field(
        "nvidia.com/gpu",
        max_length=253,
        pattern=r"^[a-z0-9.-]+/[a-z0-9.-]+$",
        description="Extended resource name of a GPU.",
    )
    gpus_per_node: int = Field(
        8,
        ge=1,
        le=64,
        description="GPUs on one node: a replica that needs more spans nodes (a "
        "LeaderWorkerSet group; parallelism decides how it is cut).",
    )
    gpu_memory: Quantity | None = Field(
        None,
        description="Memory of one GPU (e.g. 80Gi), for capacity planning; common gpuProduct "
        "values are known.",
    )
    cpu: Quantity = Field("8", description="CPU request per engine pod.")
    memory: Quantity = Field("64Gi", description="Memory request and limit per engine pod.")
    shared_memory: Quantity = Field(
        "16Gi", description="Size of /dev/shm for multi-GPU replicas (NCCL needs it)."
    )
    rdma_resource: str | None = Field(
        None,
        max_length=253,
        pattern=r"^[a-z0-9.-]+/[a-z0-9._-]+$",
        description="Extended resource of an RDMA NIC (e.g. rdma/ib), one asked per pod of a "
        "multi-node replica, with the IPC_LOCK capability verbs need (outside the restricted "
        "Pod Security Standard).",
    )


class ServingMode(StrEnum):
    UNIFIED = "unified"
    DISAGGREGATED = "disaggregated"


class RoleName(StrEnum):
    """What an engine replica does: everything (unified), or one half of a disaggregated tier."""

    UNIFIED = "unified"
    PREFILL = "prefill"
    DECODE = "decode"


class RoleSpec(ApiModel):
    """One role (prefill or decode) of a disaggregated tier."""

    replicas: ReplicaBounds = nested(ReplicaBounds, "Replica bounds of this role.")
    parallelism: Parallelism | None = Field(
        None, description="Overrides the tier's parallelism for this role."
    )
    pod_template: PodTemplateOverlay | None = Field(
        None, description="Added to this role's engine pods, over the tier's podTemplate."
    )


class KvConnector(StrEnum):
    NIXL = "NixlConnector"
    LMCACHE = "LMCacheConnectorV1"
    P2P_NCCL = "P2pNcclConnector"


class KvTransfer(ApiModel):
    """How decode replicas pull the prompt's KV blocks from prefill replicas."""

    connector: KvConnector = Field(KvConnector.NIXL, description="vLLM KV connector.")


class Serving(ApiModel):
    """Unified serving, or disaggregated prefill + decode roles."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel_rules(
            (
                "self.mode != 'disaggregated' || (has(self.prefill) && has(self.decode))",
                Rule.DISAGG_NEEDS_ROLES,
            ),
            (
                "self.mode != 'unified' || (!has(self.prefill) && !has(self.decode))",
                Rule.UNIFIED_NO_ROLES,
            ),
            ("self.mode != 'disaggregated' || !has(self.replicas)", Rule.DISAGG_NO_REPLICAS),
            ("self.mode == 'disaggregated' || !has(self.kvTransfer)", Rule.KV_TRANSFER_DISAGG_ONLY),
        )
    }

    mode: ServingMode = Field(ServingMode.UNIFIED, description="unified or disaggregated.")
    replicas: ReplicaBounds | None = Field(
        None, description="Replica bounds in unified mode (default min 1, max 1)."
    )
    prefill: RoleSpec | None = Field(None, description="Prefill role (disaggregated mode).")
    decode: RoleSpec | None = Field(None, description="Decode role (disaggregated mode).")
    kv_transfer: KvTransfer | None = Field(
        None, description="KV hand-off between roles (disaggregated; default NixlConnector)."
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.mode is ServingMode.DISAGGREGATED:
            if self.prefill is None or self.decode is None:
                raise ValueError(Rule.DISAGG_NEEDS_ROLES)
            if self.replicas is not None:
                raise ValueError(Rule.DISAGG_NO_REPLICAS)
        else:
            if self.prefill is not None or self.decode is not None:
                raise ValueError(Rule.UNIFIED_NO_ROLES)
            if self.kv_transfer is not None:
                raise ValueError(Rule.KV_TRANSFER_DISAGG_ONLY)
        return self


class Complexity(ApiModel):
    """Which requests a tier takes, by the router's complexity score in [0, 1]."""

    up_to: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Requests scored at most this go to this tier; the last tier takes the rest.",
    )


class Slo(ApiModel):
    """Latency objectives the autoscaler holds."""

    ttft_p95: Duration | None = Field(
        None, description="95th percentile time to first token (prefill/unified replicas)."
    )
    tpot_p95: Duration | None = Field(
        None, description="95th percentile time per output token (decode/unified replicas)."
    )


class ScaleBehavior(ApiModel):
    """How fast one direction of scaling may move."""

    stabilization: Duration = Field(
        timedelta(0), description="Window over which recommendations are smoothed."
    )
    max_rate: float = Field(
        2.0, ge=1.0, le=100.0, description="Most a step may multiply (or divide) replicas by."
    )


class ScaleUpBehavior(ScaleBehavior):
    """How fast replicas may be added, and whether ahead of demand."""

    predictive: bool = Field(
        False,
        description="Also scale for the arrival rate projected over the observed cold start "
        "(the linear trend of recent windows), so replicas are ready when a ramp arrives.",
    )


def _scale_down_default() -> ScaleBehavior:
    # Five minutes: long enough to ride out a lull between bursts without paying a cold start
    # (engine pods take minutes to load weights), short enough to give GPUs back within the hour.
    return ScaleBehavior(stabilization=timedelta(minutes=5))


class AutoscalingMode(StrEnum):
    AUTO = "auto"
    RECOMMEND = "recommend"
    DISABLED = "disabled"
    # An HPA or a KEDA ScaledObject on the role's Deployment owns its replicas: fleetpilot's
    # autoscaler stays out and the operator never changes replicas after creating it.
    EXTERNAL = "external"


class Autoscaling(ApiModel):
    """SLO-driven scaling of each role of the tier."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel_rules(
            (
                "duration(self.scaleDown.stabilization) >= duration(self.scaleUp.stabilization)",
                Rule.SCALE_DOWN_WINDOW,
            )
        )
    }

    mode: AutoscalingMode = Field(
        AutoscalingMode.AUTO,
        description=(
            "auto scales; recommend only records decisions; disabled keeps spec replicas; "
            "external leaves replicas to an HPA or KEDA on the role's Deployment."
        ),
    )
    interval: Duration = Field(
        timedelta(seconds=15), description="How often to decide (at least one scrape interval)."
    )
    window: Duration = Field(
        timedelta(minutes=1), description="PromQL rate window for latency percentiles."
    )
    slo: Slo = nested(Slo, "Latency objectives.")
    kv_cache_usage_target: float = Field(
        0.8, gt=0.0, le=1.0, description="Target KV-cache usage of decode/unified replicas."
    )
    queue_target: float = Field(
        2.0, gt=0.0, le=1000.0, description="Target waiting requests per replica."
    )
    tolerance: float = Field(
        0.1, ge=0.0, lt=1.0, description="No change while every ratio is within 1 +- tolerance."
    )
    scale_up: ScaleUpBehavior = nested(ScaleUpBehavior, "Scale-up behaviour.")
    scale_down: ScaleBehavior = Field(
        default_factory=_scale_down_default,
        description="Scale-down behaviour (default stabilization 5m).",
        json_schema_extra={"default": _scale_down_default().to_wire()},
    )
    max_cold_start: Duration | None = Field(
        None,
        description="With replicas.min 0: scaling to zero is refused while the observed cold "
        "start (status coldStart, pod created to Ready) is longer than this.",
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.scale_down.stabilization < self.scale_up.stabilization:
            raise ValueError(Rule.SCALE_DOWN_WINDOW)
        return self


# vLLM's ``--max-lora-rank`` values (``vllm.config.lora.MaxLoRARanks`` of the pinned release).
LoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]
# The API server prices the service's adapter-name rules by the worst case (8 tiers of this
# many adapters, names of the longest length): 32 adapters of 128 characters cost 3.5x its
# budget.
MAX_ADAPTERS_PER_TIER = 16
# Clients name an adapter in the request's `model` field, and vLLM's `--lora-modules name=path`
# splits at the first '=': a name like a served model name.
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._:/-]*[A-Za-z0-9])?$"


class AdapterHuggingFace(ApiModel):
    """An adapter repository on the Hugging Face Hub (PEFT format)."""

    repo: str = Field(
        min_length=3,
        max_length=256,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="Repository id, owner/name.",
    )
    revision: str | None = Field(
        None, max_length=128, description="Branch, tag or commit (pin a commit for GitOps)."
    )
    token_secret_ref: SecretKeyRef | None = Field(
        None, description="Secret key holding a Hub token, for private adapters."
    )


class AdapterPvc(ApiModel):
    """An adapter directory on a PersistentVolumeClaim (mounted read-only)."""

    claim_name: str = Field(min_length=1, max_length=253, description="PVC name.")
    path: str = Field(
        min_length=1,
        max_length=1024,
        # Relative, and no '.' or '..' component: the path stays inside the volume.
        pattern=r"^\.?[A-Za-z0-9_-][A-Za-z0-9._-]*(/\.?[A-Za-z0-9_-][A-Za-z0-9._-]*)*$",
        description="Directory of the adapter inside the volume (adapter_config.json there).",
    )


class AdapterSource(ApiModel):
    """Where an adapter's files come from: exactly one source."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel_rules(
            ("has(self.pvc) != has(self.huggingface)", Rule.ADAPTER_SOURCE_ONE_OF)
        )
    }

    huggingface: AdapterHuggingFace | None = Field(
        None, description="Download the adapter from the Hugging Face Hub."
    )
    pvc: AdapterPvc | None = Field(None, description="Read the adapter from a PVC.")

    @model_validator(mode="after")
    def _check(self) -> Self:
        if (self.pvc is None) == (self.huggingface is None):
            raise ValueError(Rule.ADAPTER_SOURCE_ONE_OF)
        return self


class Adapter(ApiModel):
    """A LoRA adapter of the tier's model, requested by its name in the `model` field."""

    name: str = Field(
        min_length=1,
        max_length=64,
        pattern=ADAPTER_NAME_PATTERN,
        description="Name clients request the adapter by; unique in the service.",
    )
    source: AdapterSource = Field(description="Where the adapter's files come from.")
    base_model: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="The model the adapter was trained on: a check that it is the tier's "
        "model.name, not a setting.",
    )


class LoraSettings(ApiModel):
    """How the engines hold LoRA adapters (vLLM's --max-loras, --max-lora-rank, ...)."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel_rules(
            ("!has(self.maxCpuLoras) || self.maxCpuLoras >= self.maxLoras", Rule.LORA_CPU_LORAS)
        )
    }

    max_loras: int = Field(
        1, ge=1, le=256, description="Most adapters in one batch (resident on the GPU)."
    )
    max_lora_rank: LoraRank = Field(16, description="Largest adapter rank the engines accept.")
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Adapters kept loaded in CPU memory, least recently used evicted "
        "(default: maxLoras).",
    )
    dynamic: bool = Field(
        False,
        description="Load and unload adapters in running engines when the list changes "
        "(vLLM's runtime LoRA updating), instead of rolling the engine pods.",
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(Rule.LORA_CPU_LORAS)
        return self


class Tier(ApiModel):
    """One model variant of the fleet. Tiers are listed cheapest first."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel_rules(
            (
                "!has(self.adapters) || self.adapters.all(a, !has(a.baseModel) "
                "|| a.baseModel == self.model.name)",
                Rule.ADAPTER_BASE_MODEL,
            ),
            (
                # vLLM 0.33's VllmConfig._post_init_kv_transfer_config sets the connector to
                # its OffloadingConnector whenever an offloading size is given, overwriting
                # the NIXL (or other) connector a P/D role's hand-off needs, without a word.
                "!has(self.engine) || !has(self.engine.kvOffload) || !has(self.serving) || "
                "self.serving.mode != 'disaggregated'",
                Rule.KV_OFFLOAD_UNIFIED_ONLY,
            ),
        )
    }

    name: DnsLabel = Field(description="Tier name, unique in the service (e.g. small, large).")
    model: ModelSpec = Field(description="The model this tier serves.")
    engine: EngineSettings = nested(EngineSettings, "Engine settings.")
    parallelism: Parallelism = nested(Parallelism, "GPU parallelism of one replica.")
    resources: Resources = nested(Resources, "Node resources of one engine pod.")
    serving: Serving = nested(Serving, "Unified or disaggregated serving.")
    complexity: Complexity = nested(Complexity, "Share of requests this tier takes.")
    autoscaling: Autoscaling = nested(Autoscaling, "Scaling policy.")
    pod_template: PodTemplateOverlay | None = Field(
        None,
        description=(
            "Added to the tier's engine pods: labels, annotations, placement, ServiceAccount, "
            "pull secrets, env, volumes, mounts, securityContext (never what fleetpilot owns)."
        ),
    )
    adapters: list[Adapter] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS_PER_TIER,
        description="LoRA adapters of the tier's model, served by every replica.",
    )
    lora: LoraSettings | None = Field(
        None,
        description="How engines hold adapters (default when adapters are listed: vLLM's).",
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if any(a.base_model not in (None, self.model.name) for a in self.adapters):
            raise ValueError(Rule.ADAPTER_BASE_MODEL)
        if self.engine.kv_offload is not None and self.serving.mode is ServingMode.DISAGGREGATED:
            raise ValueError(Rule.KV_OFFLOAD_UNIFIED_ONLY)
        return self

    @property
    def lora_settings(self) -> LoraSettings | None:
        """The engines' LoRA settings: None when the tier serves no adapters."""
        if self.lora is None and not self.adapters:
            return None
        return self.lora or LoraSettings()

    def roles(self) -> list[ResolvedRole]:
        """The roles this tier runs, resolved: one unified role, or prefill then decode, each
        with its replica bounds and its parallelism (the role's override, else the tier's)."""
        serving = self.serving
        if serving.mode is ServingMode.UNIFIED:
            bounds = serving.replicas or ReplicaBounds()
            return [ResolvedRole(self, RoleName.UNIFIED, bounds, self.parallelism)]
        roles = []
        for name, spec in ((RoleName.PREFILL, serving.prefill), (RoleName.DECODE, serving.decode)):
            assert spec is not None  # guaranteed by Serving's validator
            parallelism = spec.parallelism or self.parallelism
            roles.append(ResolvedRole(self, name, spec.replicas, parallelism, spec.pod_template))
        return roles

    @property
    def role_names(self) -> list[RoleName]:
        return [role.name for role in self.roles()]

    def role(self, name: str) -> ResolvedRole | None:
        """The role called ``name``, or None when this tier does not run it."""
        return next((role for role in self.roles() if role.name == name), None)


@dataclass(frozen=True)
class ResolvedRole:
    """One role of one tier with what it runs with: what becomes one engine Deployment."""

    tier: Tier
    name: RoleName
    replicas: ReplicaBounds
    parallelism: Parallelism
    role_pod_template: PodTemplateOverlay | None = None

    @property
    def pod_template(self) -> PodTemplateOverlay:
        """The tier's overlay with this role's over it."""
        return combine(self.tier.pod_template, self.role_pod_template)

    @property
    def engine(self) -> EngineSettings:
        """Engine settings are the tier's: both halves of a P/D tier run the same engine."""
        return self.tier.engine

    @property
    def disaggregated(self) -> bool:
        return self.name is not RoleName.UNIFIED


class Affinity(ApiModel):
    """Prefix-cache affinity of the router."""

    block_chars: int = Field(64, ge=16, le=4096, description="Characters per hashed prompt block.")
    weight: float = Field(3.0, ge=0.0, le=100.0, description="Weight of the prefix-match score.")


class Spillover(ApiModel):
    """Capacity-aware spill-over to the next tier."""

    enabled: bool = Field(True, description="Send to the next tier when the chosen one is full.")
    queue_threshold: float = Field(
        4.0, ge=0.0, le=10_000.0, description="Waiting requests per replica that mean saturated."
    )


class Tenant(ApiModel):
    """One client of the fleet: its API keys, and what they may use."""

    name: DnsLabel = Field(description="Tenant name: what logs and metrics say (never a key).")
    keys_secret_ref: SecretKeyRef = Field(
        description="The Secret key holding this tenant's API keys, one per line (two during "
        "a rotation). The router reads it from a mounted file and re-reads it when the "
        "Secret changes, without a restart.",
    )
    tiers: list[DnsLabel] = Field(
        default_factory=list,
        max_length=MAX_TIERS,
        description="Tiers its keys may use (the router chooses among these); empty: all.",
    )
    adapters: list[Annotated[str, StringConstraints(min_length=1, max_length=128)]] = Field(
        default_factory=list,
        max_length=64,
        description="LoRA adapters its keys may request; empty: all.",
    )
    requests_per_minute: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="Requests a minute its keys may send, over the whole service (each of the "
        "routing.replicas routers admits its share); unset: no limit.",
    )
    tokens_per_minute: int | None = Field(
        None,
        ge=1,
        le=10_000_000_000,
        description="Tokens a minute (prompt and completion; max_tokens reserved at "
        "admission, corrected by the answer's usage), over the whole service; unset: no limit.",
    )
    weight: float = Field(
        1.0,
        gt=0.0,
        le=1000.0,
        description="Its share of a saturated fleet against the other tenants of its priority "
        "(routing.flowControl): twice the weight, twice the turns.",
    )
    priority: int = Field(
        0,
        ge=0,
        le=9,
        description="Its class when the fleet is saturated (routing.flowControl): a higher "
        "class always goes first, and is shed last.",
    )


class Auth(ApiModel):
    """API keys: every request must carry ``Authorization: Bearer <key>`` of a tenant, checked
    by the router before any routing work (401 without, 403 for a tier or adapter the tenant
    may not use)."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel_rules(
            (
                "self.tenants.all(t, self.tenants.exists_one(u, u.name == t.name))",
                Rule.TENANT_NAMES_UNIQUE,
            )
        )
    }

    tenants: list[Tenant] = Field(
        min_length=1, max_length=MAX_TENANTS, description="The fleet's clients."
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        tenant_names = [t.name for t in self.tenants]
        if len(set(tenant_names)) != len(tenant_names):
            raise ValueError(Rule.TENANT_NAMES_UNIQUE)
        return self


class FlowControl(ApiModel):
    """What the router does when every replica that could serve a request is saturated: queue
    it, per tenant, instead of answering 429 at once."""

    max_wait: Duration = Field(
        timedelta(seconds=30),
        description="Longest a request waits for capacity before 429 (within requestTimeout).",
    )
    max_queued: int = Field(
        1024,
        ge=1,
        le=1_000_000,
        description="Requests one router replica holds waiting; past it the newest of the "
        "lowest priority class is shed (429).",
    )
    headroom: int = Field(
        2,
        ge=0,
        le=1024,
        description="While several tenants are active on a tier, the batch slots each keeps "
        "free for its next requests (within its weighted share of the tier's slots), so its "
        "request starts at once however much another sends; 0: work-conserving (a request "
        "waits for the next slot to free).",
    )


# A namespace name: a DNS-1123 label (it may start with a digit, unlike a Service name).
NamespaceName = Annotated[
    str, StringConstraints(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
]
# The Gateway API's Hostname (a wildcard allowed as the first label only).
GatewayHostname = Annotated[
    str,
    StringConstraints(
        pattern=r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
        max_length=253,
    ),
]
# The Gateway API's SectionName (a listener's name).
SectionName = Annotated[
    str,
    StringConstraints(
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
        max_length=253,
    ),
]


class EndpointPickerFailureMode(StrEnum):
    """What the gateway does when the endpoint picker does not answer (the InferencePool's
    ``endpointPickerRef.failureMode``)."""

    FAIL_CLOSE = "FailClose"
    FAIL_OPEN = "FailOpen"


class GatewayParentRef(ApiModel):
    """A Gateway the service's HTTPRoute attaches to (the Gateway API's ParentReference)."""

    name: str = Field(min_length=1, max_length=253, description="The Gateway's name.")
    namespace: NamespaceName | None = Field(
        None, description="The Gateway's namespace (default: the service's)."
    )
    section_name: SectionName | None = Field(
        None, description="One listener of the Gateway (default: every listener that allows it)."
    )


class GatewayRouting(ApiModel):
    """Serve through an inference gateway (the Gateway API Inference Extension): the operator
    writes an InferencePool (inference.networking.k8s.io/v1) of the service's engine pods whose
    endpoint picker is the router (its ``epp`` port, ext_proc over TLS), and with ``parentRefs``
    an HTTPRoute from those Gateways to the pool. The gateway then sends each request straight
    to the engine the router picks, with the router's tiers, prefix affinity, load, adapters,
    tenant keys and fair queue; the router's own HTTP port keeps serving as before."""

    parent_refs: list[GatewayParentRef] = Field(
        default_factory=list,
        max_length=32,
        description="Gateways whose HTTPRoute sends this service's requests to its "
        "InferencePool; empty: no HTTPRoute (route to the pool yourself).",
    )
    hostnames: list[GatewayHostname] = Field(
        default_factory=list,
        max_length=16,
        description="Host names the HTTPRoute matches (empty: every host of its listeners).",
    )
    failure_mode: EndpointPickerFailureMode = Field(
        EndpointPickerFailureMode.FAIL_CLOSE,
        description="FailClose: the gateway refuses requests while no router answers it; "
        "FailOpen: it sends them to any engine of the pool, past affinity, load and the fair "
        "queue (refused with routing.auth, whose keys it would bypass, and with more than one "
        "tier, whose models it would mix up).",
    )
    proxy_namespaces: list[NamespaceName] = Field(
        default_factory=list,
        max_length=16,
        description="Namespaces where the gateway's proxies run: with networkPolicy, engines "
        "accept requests and the router the picker's port from there only; empty: from "
        "anywhere (a managed gateway's proxies are outside the cluster).",
    )

    @property
    def fails_open(self) -> bool:
        return self.failure_mode is EndpointPickerFailureMode.FAIL_OPEN


class Routing(ApiModel):
    """The router in front of the tiers."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel_rules(
            (
                "!has(self.gateway) || !has(self.auth) || !has(self.gateway.failureMode) || "
                "self.gateway.failureMode != 'FailOpen'",
                Rule.GATEWAY_FAIL_OPEN_AUTH,
            )
        )
    }

    replicas: int = Field(2, ge=1, le=100, description="Router pods.")
    affinity: Affinity = nested(Affinity, "Prefix-cache affinity.")
    load_weight: float = Field(1.0, ge=0.0, le=100.0, description="Weight of the load score.")
    adapter_weight: float = Field(
        2.0,
        ge=0.0,
        le=100.0,
        description="Weight of a replica having the request's LoRA adapter loaded already.",
    )
    retries: int = Field(2, ge=0, le=5, description="Retries on another replica before 1st byte.")
    stream_resumes: int = Field(
        1,
        ge=0,
        le=3,
        description="Times a stream whose engine dies or freezes mid-answer is continued on "
        "another replica (the prompt plus what was sent; the client sees one stream); 0: the "
        "stream ends with an error event.",
    )
    spillover: Spillover = nested(Spillover, "Spill-over between tiers.")
    request_timeout: Duration = Field(
        timedelta(minutes=10), description="Upper bound on one request."
    )
    max_cold_start_hold: Duration | None = Field(
        None,
        description=(
            "Longest a request is held for a tier at zero replicas while its first replica "
            "starts (within requestTimeout; 0s: answer 503 at once). Within it the hold lasts "
            "the tier's observed cold start x 1.5 + 10s + monitoring.scrapeInterval, then 503 "
            "with Retry-After; unset: requestTimeout."
        ),
    )
    max_body_bytes: int = Field(
        10 * 1024 * 1024, ge=1024, le=1 << 30, description="Largest accepted request body."
    )
    auth: Auth | None = Field(
        None, description="API keys per tenant; unset: the router admits every request."
    )
    flow_control: FlowControl | None = Field(
        None,
        description="Queue requests fairly across tenants while every replica is saturated; "
        "unset: answer 429 at once.",
    )
    gateway: GatewayRouting | None = Field(
        None,
        description="Serve through an inference gateway (Gateway API Inference Extension) "
        "with the router as its endpoint picker; unset: the router's Service only.",
    )
    cpu: Quantity = Field("1", description="CPU request per router pod.")
    memory: Quantity = Field("1Gi", description="Memory request and limit per router pod.")
    priority_class_name: str | None = Field(
        None,
        max_length=253,
        description=(
            "PriorityClass of router pods: the fleet's front door, worth more than the pods "
            "a node evicts first (the chart can create one: routerPriorityClass)."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.gateway is not None and self.gateway.fails_open and self.auth is not None:
            raise ValueError(Rule.GATEWAY_FAIL_OPEN_AUTH)
        return self


class PodMonitorMode(StrEnum):
    AUTO = "auto"
    DISABLED = "disabled"


class Monitoring(ApiModel):
    """Where metrics are read from and how engines are scraped."""

    prometheus_url: str | None = Field(
        None,
        max_length=2048,
        pattern=r"^https?://",
        description="Prometheus the autoscaler queries (default: the operator's setting).",
    )
    pod_monitor: PodMonitorMode = Field(
        PodMonitorMode.AUTO,
        description="auto creates a PodMonitor when the Prometheus Operator CRD exists.",
    )
    scrape_interval: Duration = Field(
        timedelta(seconds=15), description="Scrape interval of engines and router."
    )


class TolerationOperator(StrEnum):
    EXISTS = "Exists"
    EQUAL = "Equal"


class TaintEffect(StrEnum):
    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


class Toleration(ApiModel):
    """A pod toleration, as in core/v1."""

    key: str | None = Field(None, max_length=316)
    operator: TolerationOperator = Field(TolerationOperator.EQUAL)
    value: str | None = Field(None, max_length=63)
    effect: TaintEffect | None = Field(None)
    toleration_seconds: int | None = Field(None, ge=0)


class Scheduling(ApiModel):
    """Placement of engine pods, added to what GPU product selection implies."""

    node_selector: dict[str, Annotated[str, StringConstraints(max_length=63)]] = Field(
        default_factory=dict, description="Extra node labels engine pods require."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Extra tolerations of engine pods."
    )
    priority_class_name: str | None = Field(
        None, max_length=253, description="PriorityClass of engine pods."
    )
    group_topology_key: str | None = Field(
        None,
        max_length=253,
        pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
        description="Node label that every pod of a multi-node replica shares a value of, one "
        "replica per value (LeaderWorkerSet exclusive topology: e.g. a rack or NVLink-domain "
        "label, so a replica's nodes talk over the fast fabric).",
    )


class NetworkPolicySettings(ApiModel):
    """NetworkPolicies around the fleet's pods (enforced by the cluster's CNI, if it does).

    Engines serve the OpenAI API and the unauthenticated P/D KV hand-off: only this service's
    router and engines reach them, plus the metrics scrape from ``metricsNamespaces``.
    """

    enabled: bool = Field(
        True,
        description="Plan NetworkPolicies: engine ports open only to this service's router "
        "and engine pods (and the metrics scrape); the router port open to all.",
    )
    metrics_namespaces: list[NamespaceName] = Field(
        default=["monitoring"],
        max_length=16,
        description="Namespaces whose pods may scrape the engines' /metrics (where "
        "Prometheus runs). It shares the serving port, so keep this list short.",
    )


class CacheAccessMode(StrEnum):
    READ_WRITE_MANY = "ReadWriteMany"
    READ_WRITE_ONCE = "ReadWriteOnce"


class ModelCache(ApiModel):
    """A volume the service's Hub and S3 models are downloaded into by a Job, once per model
    revision; engine pods mount it read-only and start only once the download is complete."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel_rules(
            ("has(self.size) != has(self.claimName)", Rule.CACHE_SIZE_OR_CLAIM)
        )
    }

    size: Quantity | None = Field(
        None,
        description="Size of a new claim the operator creates (owned by the service). "
        "Downloads the service no longer plans (an old revision) are removed from it once its "
        "engines have rolled out.",
    )
    storage_class_name: str | None = Field(
        None, min_length=1, max_length=253, description="Storage class of the new claim."
    )
    access_mode: CacheAccessMode = Field(
        CacheAccessMode.READ_WRITE_MANY,
        description="ReadWriteMany lets engines on every node mount it; ReadWriteOnce only "
        "fits a single-node cluster.",
    )
    claim_name: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        description="An existing ReadWriteMany claim instead (one cache for several "
        "services). Nothing is removed from it: other services may read what this one no "
        "longer plans.",
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if (self.size is None) == (self.claim_name is None):
            raise ValueError(Rule.CACHE_SIZE_OR_CLAIM)
        return self


def _complexity_list() -> str:
    return "self.tiers.map(t, t.complexity.upTo)"


class InferenceServiceSpec(ApiModel):
    """An autoscaled, complexity-routed fleet of model tiers."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": cel_rules(
            (
                "self.tiers.all(t, self.tiers.exists_one(u, u.name == t.name))",
                Rule.TIER_NAMES_UNIQUE,
            ),
            (
                f"{_complexity_list()}.isSorted() && {_complexity_list()}.all(x, "
                f"{_complexity_list()}.indexOf(x) == {_complexity_list()}.lastIndexOf(x))",
                Rule.COMPLEXITY_INCREASING,
            ),
            (
                "self.tiers.all(t, !has(t.adapters) || t.adapters.all(a, "
                "t.adapters.exists_one(b, b.name == a.name) && self.tiers.exists_one(u, "
                "has(u.adapters) && u.adapters.exists(b, b.name == a.name))))",
                Rule.ADAPTER_NAMES_UNIQUE,
            ),
            (
                "self.tiers.all(t, !has(t.adapters) || t.adapters.all(a, self.tiers.all(u, "
                "a.name != (has(u.model.servedName) ? u.model.servedName : u.model.name))))",
                Rule.ADAPTER_NOT_A_MODEL,
            ),
            (
                "!has(self.routing) || !has(self.routing.gateway) || "
                "!has(self.routing.gateway.failureMode) || "
                "self.routing.gateway.failureMode != 'FailOpen' || size(self.tiers) == 1",
                Rule.GATEWAY_FAIL_OPEN_TIERS,
            ),
        )
    }

    tiers: list[Tier] = Field(
        min_length=1, max_length=MAX_TIERS, description="Model tiers, cheapest first."
    )
    routing: Routing = nested(Routing, "Router settings.")
    monitoring: Monitoring = nested(Monitoring, "Metrics settings.")
    scheduling: Scheduling = nested(Scheduling, "Engine pod placement.")
    network_policy: NetworkPolicySettings = nested(
        NetworkPolicySettings, "Who may reach the fleet's pods."
    )
    model_cache: ModelCache | None = Field(
        None,
        description="Download Hub and S3 models once into a shared volume instead of in "
        "every engine pod.",
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(Rule.TIER_NAMES_UNIQUE)
        bounds = [t.complexity.up_to for t in self.tiers]
        if any(a >= b for a, b in pairwise(bounds)):
            raise ValueError(Rule.COMPLEXITY_INCREASING)
        adapters = [a.name for t in self.tiers for a in t.adapters]
        if len(set(adapters)) != len(adapters):
            raise ValueError(Rule.ADAPTER_NAMES_UNIQUE)
        if set(adapters) & {t.model.alias for t in self.tiers}:
            raise ValueError(Rule.ADAPTER_NOT_A_MODEL)
        gateway = self.routing.gateway
        if gateway is not None and gateway.fails_open and len(self.tiers) > 1:
            raise ValueError(Rule.GATEWAY_FAIL_OPEN_TIERS)
        return self
