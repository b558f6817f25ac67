"""EngineConfig: every engine knob with its default and validation, in one place."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

LOAD_FORMATS = ("auto", "safetensors", "dummy")
QUANTIZATIONS = (None, "fp8")
SPECULATIVE_METHODS = ("ngram", "mtp")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a draft source proposes up to `num_speculative_tokens` tokens per step and the target
    verifies them in one forward (spec/ package). `method`: "ngram" (prompt lookup: the tokens that followed the
    latest earlier occurrence of the longest suffix n-gram, n from prompt_lookup_max down to prompt_lookup_min) or
    "mtp" (the model's own multi-token-prediction layer, Ling-2.6's NEXTN; chained, top-1)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None  # ngram only (default 2)
    prompt_lookup_max: int | None = None  # ngram only (default 4)

    def __post_init__(self) -> None:
        for name, value in self.checked(vars(self)).items():
            object.__setattr__(self, name, value)

    @staticmethod
    def checked(values: dict, names: dict[str, str] | None = None) -> dict:
        """`values` (the four fields) with the n-gram defaults filled in, or a ValueError that names the offending
        key as the user spelled it: `names` maps a key to e.g. its CLI flag (default 'speculative_config KEY'), so
        a bad flag is reported as that flag. Types first: a string "2" or True must not reach the comparisons."""
        def label(key: str) -> str:
            return (names or {}).get(key) or f"speculative_config {key}"

        def fail(key: str, why: str) -> None:
            raise ValueError(f"invalid {label(key)}={values.get(key)!r}: {why}")

        def integer(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        method, k = values.get("method"), values.get("num_speculative_tokens")
        if not isinstance(method, str) or method not in SPECULATIVE_METHODS:
            fail("method", f"must be one of {', '.join(SPECULATIVE_METHODS)}")
        if not integer(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            fail("num_speculative_tokens", f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        n_min, n_max = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        for key, value in (("prompt_lookup_min", n_min), ("prompt_lookup_max", n_max)):
            if value is not None and method != "ngram":
                fail(key, "applies to method 'ngram' only")
            if value is not None and (not integer(value) or value < 1):
                fail(key, "must be an integer >= 1")
        if method == "ngram":
            n_min = 2 if n_min is None else n_min
            n_max = max(4, n_min) if n_max is None else n_max
            if n_max < n_min:
                fail("prompt_lookup_max", f"must be >= {label('prompt_lookup_min')} ({n_min})")
        return {"method": method, "num_speculative_tokens": k, "prompt_lookup_min": n_min, "prompt_lookup_max": n_max}

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict) -> SpeculativeConfig:
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or SpeculativeConfig, not {type(value).__name__}")
        unknown = set(value) - {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}; known: method, "
                             "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"speculative_config needs {key!r}")
        return cls(**value)


@dataclass
class EngineConfig:
    model: str  # HF-layout directory (the CLI and LLM() substitute the built-in demo checkpoint when none is given)
    tokenizer: str | None = None  # defaults to the model directory
    dtype: str = "auto"  # auto (the checkpoint's torch_dtype) | bfloat16 | float16 | float32
    device: str = "auto"  # auto (cuda when available) | cpu | cuda | cuda:N
    hf_overrides: dict = field(default_factory=dict)  # model-config keys merged over config.json
    seed: int = 0  # seeds requests that bring no seed of their own
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    page_size: int = 16
    max_running_requests: int = 256
    max_num_batched_tokens: int = 8192  # tokens per forward (prefill chunks + decode rows)
    kv_cache_memory_bytes: int | None = None  # cache budget on CPU (KV + state); default 1 GiB
    gpu_memory_utilization: float = 0.9  # fraction of the GPU this engine may hold (other processes' use aside)
    max_state_slots: int | None = None  # pin the number of state slots instead of sizing them
    state_to_kv_ratio: float = 0.9  # state bytes : KV bytes when slots are sized from memory
    chunked_prefill_size: int | None = None  # max prompt tokens of one request per step (default: the token budget)
    enable_prefix_caching: bool = True
    state_checkpoint_interval: int = 256  # sparse-state models: checkpoint every N tokens (a multiple of page_size)
    checkpoint_slots_per_request: int = 2  # sparse-state models: slot headroom per running request for checkpoints
    # Speculative decoding ({"method": "ngram" | "mtp", "num_speculative_tokens": k, ...}, see SpeculativeConfig);
    # None: off. The planner reserves k intermediate states per running request.
    speculative_config: SpeculativeConfig | dict | None = None
    kernel_backend: str = "auto"  # auto (Triton kernels on CUDA) | triton | torch (the pure-torch references)
    enforce_eager: bool = False  # run every step op by op: no CUDA graphs
    # Decode rows the largest graph replays (default min(256, running cap)); with speculative decoding the verify
    # graphs hold as many tokens, i.e. up to max(1, cuda_graph_max_bs // (k + 1)) requests of 1 + k tokens.
    cuda_graph_max_bs: int | None = None
    # Prefill and mixed steps of up to 32 rows (each wanting at most one logits row) and this many tokens replay
    # CUDA graphs, one per size: powers of two from 16 to 1024, then multiples of 1024 (models whose prefill reads
    # no other host value: ZAYA1); capped by max_num_batched_tokens; 0: none.
    prefill_graph_max_tokens: int = 8192
    tensor_parallel_size: int = 1  # ranks (processes, one GPU each on CUDA) that shard every layer
    nnodes: int = 1  # machines the tensor-parallel ranks span (tensor_parallel_size / nnodes ranks on each)
    node_rank: int = 0  # this machine's index; node 0 runs the engine (and the server), the others only ranks
    dist_init_addr: str | None = None  # host:port of node 0's rendezvous (default: a free local port, one node)
    disable_overlap_schedule: bool = False  # process each step before scheduling the next (no host/device overlap)
    skip_warmup: bool = False  # skip compiling every kernel variant at start-up (they then compile in the first steps)
    use_tqdm: bool = True  # a progress bar while the weights load
    load_format: str = "auto"  # auto = safetensors (the checkpoint's weights) | dummy (random, from config.json alone)
    # None: as the checkpoint is (16-bit, or FP8 by its quantization_config); "fp8": quantize a 16-bit checkpoint's
    # projections and experts to FP8 e4m3 while loading (per-channel weight scales, per-token activation scales).
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # the KV cache's dtype: auto = the model's dtype (the only value served so far)

    def __post_init__(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"invalid engine option {name}={getattr(self, name)!r}: {why}")

        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            fail("page_size", "must be a power of two")
        if self.max_running_requests < 1:
            fail("max_running_requests", "must be >= 1")
        if self.max_num_batched_tokens < 1:
            fail("max_num_batched_tokens", "must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            fail("gpu_memory_utilization", "must be in (0, 1]")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            fail("kv_cache_memory_bytes", "must be positive")
        if self.max_state_slots is not None and self.max_state_slots < 1:
            fail("max_state_slots", "must be >= 1")
        if self.state_to_kv_ratio <= 0:
            fail("state_to_kv_ratio", "must be positive")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            fail("chunked_prefill_size", "must be >= 1")
        if self.state_checkpoint_interval < self.page_size or self.state_checkpoint_interval % self.page_size:
            fail("state_checkpoint_interval", f"must be a positive multiple of page_size ({self.page_size})")
        if self.checkpoint_slots_per_request < 0:
            fail("checkpoint_slots_per_request", "must be >= 0")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.max_model_len is not None and self.max_model_len < 2:
            fail("max_model_len", "must be >= 2")
        if self.tensor_parallel_size < 1:
            fail("tensor_parallel_size", "must be >= 1")
        if self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            fail("nnodes", f"must be >= 1 and divide tensor_parallel_size ({self.tensor_parallel_size})")
        if not 0 <= self.node_rank < self.nnodes:
            fail("node_rank", f"must be in [0, nnodes={self.nnodes})")
        if self.nnodes > 1 and not self.dist_init_addr:
            fail("dist_init_addr", "is needed (host:port of node 0) when the ranks span several nodes")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            fail("cuda_graph_max_bs", "must be >= 1")
        if self.prefill_graph_max_tokens < 0:
            fail("prefill_graph_max_tokens", "must be >= 0 (0: no prefill graphs)")
        if self.kernel_backend not in ("auto", "triton", "torch"):
            fail("kernel_backend", "must be auto, triton or torch")
        if self.load_format not in LOAD_FORMATS:
            fail("load_format", f"must be one of {', '.join(LOAD_FORMATS)}")
        if self.quantization not in QUANTIZATIONS:
            fail("quantization", f"must be one of {', '.join(map(str, QUANTIZATIONS))}")
        if self.kv_cache_dtype != "auto":
            fail("kv_cache_dtype", "must be auto (the model's dtype): FP8 KV caches are not served yet")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            fail("device", "must be auto, cpu, cuda or cuda:N")

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens per verify row (0: no speculative decoding)."""
        return self.speculative_config.num_speculative_tokens if self.speculative_config is not None else 0

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device='cuda' was requested but CUDA is not available")
        return device
