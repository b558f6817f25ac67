"""EngineConfig: every engine knob with its default and validation, in one place."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridserve.options import option, option_flag
from hybridserve.sampling import MAX_LOGPROBS

LOAD_FORMATS = ("auto", "safetensors", "dummy")
QUANTIZATIONS = (None, "fp8")
DTYPES = ("auto", "bfloat16", "float16", "float32")
KERNEL_BACKENDS = ("auto", "triton", "torch")
SPECULATIVE_METHODS = ("ngram", "mtp")
MAX_SPECULATIVE_TOKENS = 16
NO_CHUNKING = -1  # chunked_prefill_size: a prompt that fits the token budget is prefilled in one step (SGLang's -1)


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
    """Every engine knob. The fields made with `option` are also `hybridserve serve` / `generate` options: the
    command line is generated from them (hybridserve/options.py), so their defaults and help live here only."""

    model: str  # HF-layout directory (hub.local_checkpoint turns a Hub id into one; the CLI and LLM() substitute
    # the built-in demo checkpoint when none is given)
    tokenizer: str | None = option(None, "tokenizer directory or Hugging Face Hub id", default_help="the model's")
    revision: str | None = option(None, "the Hub revision (branch, tag or commit) of a model given by id",
                                  default_help="main")
    download_dir: str | None = option(None, "where Hub models are downloaded and looked up (a huggingface_hub "
                                            "cache directory)", default_help="$HF_HUB_CACHE, ~/.cache/huggingface/hub")
    generation_config: str = option(
        "auto", "where requests' sampling defaults come from: auto = the model's generation_config.json (its "
                "temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens, for the "
                "fields a request leaves unset); vllm = the engine's own defaults (the model's end-of-sequence ids "
                "still apply); DIR = the generation_config.json in DIR instead of the model's",
        metavar="auto|vllm|DIR")
    dtype: str | torch.dtype = option("auto", "weight and activation dtype (auto: the checkpoint's torch_dtype)",
                                      choices=DTYPES)
    device: str = option("auto", "auto (cuda when available) | cpu | cuda | cuda:N")
    hf_overrides: dict = option(help="model-config keys merged over config.json, as JSON (e.g. "
                                     "'{\"mod_skip_mode\": \"zero\"}')", metavar="JSON", default_factory=dict)
    seed: int = option(0, "seed for requests that bring none (and for --load-format dummy weights)",
                       flags=("--seed", "--random-seed"))
    max_model_len: int | None = option(None, "context length", flags=("--max-model-len", "--context-length"),
                                       default_help="the model's, lowered to what the KV cache holds")
    page_size: int = option(16, "tokens per KV-cache page (a power of two)", flags=("--page-size", "--block-size"))
    max_running_requests: int = option(256, "requests decoded together",
                                       flags=("--max-running-requests", "--max-num-seqs"))
    max_num_batched_tokens: int = option(8192, "tokens per forward pass (prefill chunks + decode rows)")
    kv_cache_memory_bytes: int | None = option(None, "cache budget (KV + state) on CPU", default_help="1 GiB")
    gpu_memory_utilization: float = option(
        0.9, "fraction of the GPU's memory this engine may hold (weights, activations, graphs, caches); other "
             "processes' use does not count, but the caches never take more than is free",
        flags=("--gpu-memory-utilization", "--mem-fraction-static"))
    max_state_slots: int | None = option(None, "pin the number of recurrent-state slots",
                                         default_help="sized from the cache budget")
    state_to_kv_ratio: float = option(0.9, "state bytes : KV bytes when the cache budget is split (unless "
                                           "--max-state-slots)")
    chunked_prefill_size: int | None = option(
        None, "most prompt tokens of one request per step; -1 (SGLang's): no chunking, a prompt that fits the "
              "token budget waits for a step with room for all of it instead of being split across steps (a longer "
              "one is still split at the budget)", default_help="the token budget, --max-num-batched-tokens")
    max_total_tokens: int | None = option(
        None, "most tokens the KV cache holds (SGLang's): caps the KV pool of the memory plan; a multiple of "
              "--page-size, and more than the cache budget holds is an error",
        default_help="what the cache budget holds")
    enable_prefix_caching: bool = option(True, "reuse KV pages and state checkpoints of shared prefixes",
                                         negation=("--disable-prefix-caching", "--no-enable-prefix-caching",
                                                   "--disable-radix-cache"))
    state_checkpoint_interval: int = option(256, "sparse-state models (Ling): checkpoint the state every N tokens "
                                                 "for the prefix cache (a multiple of --page-size)")
    checkpoint_slots_per_request: int = option(2, "sparse-state models: state-slot headroom per running request "
                                                  "for checkpoints")
    # Speculative decoding ({"method": "ngram" | "mtp", "num_speculative_tokens": k, ...}, see SpeculativeConfig);
    # None: off. The planner reserves k intermediate states per running request. (CLI: --speculative-*.)
    speculative_config: SpeculativeConfig | dict | None = None
    kernel_backend: str = option("auto", "auto: Triton kernels on CUDA, the pure-torch references elsewhere; torch: "
                                         "references everywhere (debugging); triton: fail unless the kernels can run",
                                 choices=KERNEL_BACKENDS)
    enforce_eager: bool = option(False, "run every step op by op: no CUDA graphs (decode or prefill)",
                                 flags=("--enforce-eager", "--disable-cuda-graph"))
    cuda_graph_max_bs: int | None = option(
        None, "largest decode batch replayed from a CUDA graph; larger decode steps run eagerly. With speculative "
              "decoding the verify graphs hold as many tokens: up to max(1, this // (K + 1)) requests of 1 + K tokens "
              "(K: --speculative-num-draft-tokens)", default_help="256 or --max-running-requests, the smaller")
    prefill_graph_max_tokens: int = option(
        8192, "prefill and mixed steps of up to 32 rows and this many tokens replay CUDA graphs captured for 16, 32, "
              "... 1024 tokens, then multiples of 1024, on models that support it (ZAYA1); capped by "
              "--max-num-batched-tokens; 0: none (such steps run eagerly, bound by the host's kernel launches)")
    tensor_parallel_size: int = option(1, "tensor-parallel ranks: one process (and GPU, on CUDA) per rank, each "
                                          "holding a shard of every layer",
                                       flags=("--tp", "--tensor-parallel-size", "--tp-size"))
    nnodes: int = option(1, "machines the --tp ranks span (--tp / --nnodes ranks on each)")
    node_rank: int = option(0, "this machine's index: 0 serves, the others only run their tensor-parallel ranks")
    dist_init_addr: str | None = option(None, "host:port where node 0 meets the other nodes' ranks (needed with "
                                              "--nnodes > 1)", default_help="a free local port, one node")
    disable_overlap_schedule: bool = option(False, "schedule each step only after the previous one is processed "
                                                   "(by default the host schedules step N+1 and processes step N "
                                                   "while the device runs N+1; outputs are the same either way)")
    skip_warmup: bool = option(False, "start without first compiling every Triton kernel variant (they then compile "
                                      "inside the first requests' steps, seconds each)")
    use_tqdm: bool = True  # a progress bar while the weights load (and a Hub download)
    load_format: str = option("auto", "auto / safetensors: the checkpoint's *.safetensors; dummy: random weights from "
                                      "config.json alone, no weight files read (benchmarks of full-size models)",
                              choices=LOAD_FORMATS)
    # None: as the checkpoint is (16-bit, or FP8 by its quantization_config); "fp8": quantize a 16-bit checkpoint's
    # projections and experts to FP8 e4m3 while loading (per-channel weight scales, per-token activation scales).
    quantization: str | None = option(
        None, "fp8: quantize a 16-bit checkpoint's projections and experts to FP8 e4m3 as they load (per-channel "
              "weight scales, per-token activation scales); FP8 checkpoints (compressed-tensors, block FP8) need "
              "nothing: their config.json says so", flags=("--quantization", "-q"),
        choices=[q for q in QUANTIZATIONS if q is not None], default_help="none: as the checkpoint is")
    kv_cache_dtype: str = option("auto", "the KV cache's dtype: auto = the model's (FP8 KV caches are not served yet)",
                                 choices=["auto"])  # the only value served so far
    max_logprobs: int = option(MAX_LOGPROBS, "most logprobs a request may ask for per token (logprobs, "
                                             "top_logprobs, prompt_logprobs)")

    def __post_init__(self) -> None:
        def fail(name: str, why: str) -> None:
            flag = option_flag(EngineConfig, name)
            raise ValueError(f"invalid engine option {name}={getattr(self, name)!r} ({flag}): {why}")

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
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1 \
                and self.chunked_prefill_size != NO_CHUNKING:
            fail("chunked_prefill_size", f"must be >= 1, or {NO_CHUNKING} for no chunking")
        if self.max_total_tokens is not None and (self.max_total_tokens < self.page_size
                                                  or self.max_total_tokens % self.page_size):
            fail("max_total_tokens", f"must be a positive multiple of page_size ({self.page_size}): the KV cache "
                                     "holds whole pages")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            fail("generation_config", "must be auto, vllm or a directory holding generation_config.json")
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
        if self.kernel_backend not in KERNEL_BACKENDS:
            fail("kernel_backend", f"must be one of {', '.join(KERNEL_BACKENDS)}")
        if self.max_logprobs < 0:
            fail("max_logprobs", "must be >= 0")
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
