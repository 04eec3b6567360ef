"""``EngineConfig``: every knob of the engine in one place, and ``EngineLimits``: what it then enforces.

``LLM``, ``LLMEngine``, the server and the command line all take one ``EngineConfig``; each field is
one command-line flag (``--max-num-seqs`` for ``max_num_seqs``; ``cli.add_config_flags`` derives
them from the fields, their defaults and the ``help`` in their metadata), so a new knob is one
line here:

    EngineConfig(model="model.gguf", max_num_seqs=16, speculative={"method": "ngram", "num_speculative_tokens": 4})
    EngineConfig.create(**kwargs)      # kwargs checked: an unknown one is named (TypeError)

``EngineLimits`` are the facts an engine derives from its config, its model and its KV budget
(the longest sequence, the most completions per request, the vocabulary). They are fixed once the
engine is built, so the checks that need no prompt (``check_params``) can run anywhere - before a
server tokenizes anything, or in a front that holds no engine at all (Ray replicas).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from minillm.generation.sampling import SamplingParams
from minillm.generation.stop import check_stop_strings
from minillm.runtime.errors import RequestRejected
from minillm.runtime.speculative import SpeculativeConfig


def knob(default, help: str, **cli):
    """A config field with its command-line help; ``cli``: ``flag`` (another name than the field's),
    ``choices``, ``parse`` (text -> value, raising ValueError), ``zero_means_none`` (0 on the command
    line: no limit)."""
    return field(default=default, metadata={"help": help, **cli})


def parse_speculative(text: str) -> dict:
    """``'{"method": "ngram", "num_speculative_tokens": 4}'`` -> the dict, checked now."""
    import json

    options = json.loads(text)  # json.JSONDecodeError is a ValueError
    if not isinstance(options, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    SpeculativeConfig.from_dict(options)
    return options


@dataclass(frozen=True)
class EngineConfig:
    """The engine's knobs. ``model``, ``backend``, ``activations``, ``tensor_parallel_size``, ``threads``
    and ``device`` are about loading the model (``LLM``); the rest are ``LLMEngine``'s."""
    model: str | None = knob(None, "a .gguf file or a Hugging Face model folder (default: SmolLM2)")
    backend: str = knob("numba", "the kernel backend, by its registered name (numba, reference, cuda ...)")
    activations: str = knob("fp32", "the linear layers' input: fp32, or quantized to int8 per block (llama.cpp's "
                                    "integer path)", choices=("fp32", "int8"))
    kv_cache_bytes: int | None = knob(None, "memory for the paged KV cache (default: min(4 GiB, a quarter of the "
                                            "available memory)); with tensor parallelism, each rank's")
    block_size: int = knob(16, "tokens per KV-cache block")
    max_num_seqs: int = knob(32, "sequences decoded together")
    max_num_batched_tokens: int = knob(512, "tokens one step computes, prefill chunks and decode together")
    max_n: int | None = knob(None, "the most completions (n) one request may ask for (default: max_num_seqs)")
    max_model_len: int | None = knob(None, "longest prompt + completion, in tokens (default: the context, or the "
                                           "KV cache if smaller)")
    jump_forward: bool = knob(True, "append the tokens a structured-output constraint forces without a forward "
                                    "each", flag="--no-jump-forward")
    speculative: dict | None = knob(None, 'speculative decoding as JSON, e.g. \'{"method": "ngram", '
                                          '"num_speculative_tokens": 4}\' (methods: ngram, self with num_draft_layers)',
                                    flag="--speculative-config", parse=parse_speculative)
    tensor_parallel_size: int = knob(1, "split the model over this many processes (torch.distributed, gloo; "
                                        "chapter 12)")
    threads: int | None = knob(None, "Numba/BLAS threads (default: one per core)")
    device: str = knob("cpu", "cuda: the whole model resident on the GPU (or, without one, on the simulator: "
                              "NUMBA_ENABLE_CUDASIM=1)", choices=("cpu", "cuda"))

    def __post_init__(self):
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be >= 1, got {self.threads!r}")
        if self.model is not None and not isinstance(self.model, str):
            object.__setattr__(self, "model", str(self.model))  # a Path is welcome; stored as text (picklable, hashable)

    @classmethod
    def create(cls, base: EngineConfig | None = None, **kwargs) -> EngineConfig:
        """``base`` (default: the defaults) with ``kwargs`` replacing its fields; an unknown keyword is
        named, with the known ones."""
        known = [f.name for f in fields(cls)]
        if unknown := [k for k in kwargs if k not in known]:
            raise TypeError(f"unknown engine option {unknown[0]!r}; the options are {', '.join(known)}")
        values = {name: getattr(base, name) for name in known} if base is not None else {}
        return cls(**{**values, **kwargs})


@dataclass(frozen=True)
class EngineLimits:
    """What an engine enforces, fixed when it is built (``LLMEngine.limits``)."""
    max_model_len: int           # the longest sequence (prompt + completion) a request may ask for
    max_n: int                   # the most completions per request
    max_num_seqs: int
    block_size: int
    vocab_size: int

    def check_params(self, params: SamplingParams) -> None:
        """The checks of a request that need no prompt, each naming the request field at fault."""
        self.check_vocabulary(params.stop_token_ids, "stop_token_ids")
        if params.n > self.max_n:  # a request's n sequences run side by side
            raise RequestRejected(f"n = {params.n} exceeds this engine's limit of {self.max_n} completions per "
                                  f"request (max_n; max_num_seqs = {self.max_num_seqs})", "n")
        try:
            check_stop_strings(params.stop)
        except ValueError as e:
            raise RequestRejected(str(e), "stop") from None

    def check_vocabulary(self, ids: list[int], param: str) -> None:
        if bad := [t for t in ids if not 0 <= t < self.vocab_size]:
            raise RequestRejected(f"{param} holds token ids outside the vocabulary [0, {self.vocab_size}): "
                                  f"{bad[:5]}", param)
