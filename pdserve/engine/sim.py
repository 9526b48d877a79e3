"""The simulated engine: a timing model instead of a model (``pdserve engine --simulate``).

Everything but the model is the real engine: server, scheduler, block manager, KV
events, load counters, heartbeats and the KV connector with its handshake and transfer.
``SimRunner`` takes ``ModelRunner``'s place: its ``execute`` sleeps for the time the
timing model gives the step (a sleep, not a spin, so a few hundred engines share a few
cores) and emits a fixed text's tokens, so a client gets a normal response and stream.
No torch: one simulated engine process holds about 80 MiB resident (the real one about
335 MiB before its model), so a few hundred run on one machine.

Timing model (``SimTiming``), per step:
  a step that prefills:  prefill_base + prefill_per_token * prompt tokens computed
                         + decode_per_seq * decodes + decode_per_kv_token * their KV tokens
  a decode-only step:    decode_base + decode_per_seq * batch + decode_per_kv_token * KV tokens
where a decode's KV tokens are its context length (tokens already in the cache, plus one).

The defaults model the embedded engine on the ``small`` preset on CPU (float32, one torch
thread, 256 MiB of KV), measured on a 2-core machine that was also running another
CPU-heavy job: the time of ``LLMEngine.step()`` (median of 3 to 8 steps) for prompts of
16, 64, 128, 256, 384 and 512 tokens (one prefill step each), and for decode batches of
1-32 requests at contexts of 32-1024 tokens (13 points, 39 to 16,768 KV tokens; 32 x 1024
does not fit the cache and was left out), fitted by least squares; residuals are within
6 ms for prefill and 15 ms for decode:
  prefill  a = 12.3 ms,  b = 0.50 ms per prompt token
  decode   c = 10.3 ms,  d = 1.0 ms per request,  e = 2.5 us per KV token
A benchmark models a faster or slower engine with the ``--sim-*`` flags (or the spec's
``engine.simulate``).

The KV cache is a real buffer the transport registers, one float32 K and V per slot
(a model of one layer, one KV head of width one), so the transfer path runs for real
and moves 8 bytes per token. The block count is the modelled model's: its KV budget
over its bytes per block, as the real engine sizes its cache.

Invariants: a simulated engine pairs only with simulated engines (its model identity
differs from the real model's); it serves neither constrained decoding nor a KV pool
and refuses them at start or admission; logprobs are 0.0 (the fixed text is certain).
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.config import PRESETS, ConfigError, EngineConfig, ModelConfig, preset_config
from pdserve.engine.request import Request, TokenLogprob
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.runtime.tokenizer import ByteTokenizer, load_tokenizer

SIM_TEXT = "The quick brown fox jumps over the lazy dog. "
"""What a simulated engine generates, over and over (a continued stream goes on where
the earlier engine stopped)."""
SIM_TRANSPORTS = ("tcp", "none")  # the ones that move a plain host buffer without torch


@dataclass
class SimTiming:
    """The step time model (module docstring); defaults fitted on the ``small`` preset."""

    prefill_base_s: float = 12.3e-3
    prefill_per_token_s: float = 0.50e-3
    decode_base_s: float = 10.3e-3
    decode_per_seq_s: float = 1.0e-3
    decode_per_kv_token_s: float = 2.5e-6

    def step_s(self, num_prefill_tokens: int, num_decodes: int, num_kv_tokens: int) -> float:
        """Seconds one step takes: ``num_prefill_tokens`` prompt tokens computed, and
        ``num_decodes`` decodes holding ``num_kv_tokens`` tokens of context together."""
        if num_prefill_tokens == 0 and num_decodes == 0:
            return 0.0
        base = (self.prefill_base_s + self.prefill_per_token_s * num_prefill_tokens
                if num_prefill_tokens else self.decode_base_s)
        return base + self.decode_per_seq_s * num_decodes + self.decode_per_kv_token_s * num_kv_tokens

    def validate(self) -> None:
        for name, value in vars(self).items():
            if not value >= 0:
                raise ConfigError(f"simulate: {name} must be at least 0, got {value!r}")


class HostKVBuffer:
    """The simulated KV cache: a zeroed host buffer with the two things the connector
    reads of a KV tensor (its address and element size)."""

    def __init__(self, num_bytes: int) -> None:
        self._buffer = (ctypes.c_char * num_bytes)()

    def data_ptr(self) -> int:
        return ctypes.addressof(self._buffer)

    def element_size(self) -> int:
        return 4  # float32


class SimRunner:
    """``ModelRunner``'s place in a simulated engine: the same ``execute``, timed by the
    model and sleeping, never computing."""

    def __init__(self, timing: SimTiming, num_blocks: int, block_size: int, modelled_kv_bytes: int,
                 token_pattern: list[int], sleep=time.sleep) -> None:
        self.timing = timing
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_cache = HostKVBuffer(num_blocks * block_size * 2 * 4)
        self.kv_cache_bytes = modelled_kv_bytes  # what the modelled engine's cache holds
        self.token_pattern = token_pattern
        self.sleep = sleep

    def execute(self, batch: ScheduledBatch, kv_ready=None) -> dict[str, int]:
        """Called by the engine once per step, as ``ModelRunner.execute``: sleeps for the
        step's modelled time, fires ``kv_ready(0)`` (the one layer's KV is in the cache),
        and returns the next pattern token of each request that completed its tokens."""
        num_prefill = num_decodes = num_kv = 0
        for request, n in batch.items:
            if request.num_computed_tokens < request.num_prompt_tokens or n > 1:
                num_prefill += n
            else:
                num_decodes += 1
                num_kv += request.num_computed_tokens + 1
        self.sleep(self.timing.step_s(num_prefill, num_decodes, num_kv))
        if kv_ready is not None:
            kv_ready(0)
        sampled: dict[str, int] = {}
        for request, n in batch.items:
            if request.needs_prompt_logprobs:
                _score_prompt(request, request.num_computed_tokens + n)
            if request.num_computed_tokens + n == request.num_tokens:
                sampled[request.request_id] = token = self.next_token(request)
                if request.sampling_params.logprobs:
                    top = [(token, 0.0)][:request.sampling_params.top_logprobs]
                    request.new_logprobs.append(TokenLogprob(token, 0.0, top))
        return sampled

    def next_token(self, request: Request) -> int:
        params = request.sampling_params
        return self.token_pattern[(params.sample_offset + len(request.output_token_ids))
                                  % len(self.token_pattern)]


def _score_prompt(request: Request, end: int) -> None:
    """Prompt logprobs of the positions computed so far: each next prompt token, 0.0."""
    prompt, k = request.prompt_token_ids, request.sampling_params.top_logprobs
    for p in range(len(request.prompt_logprobs), min(end, len(prompt) - 1)):
        request.prompt_logprobs.append(TokenLogprob(prompt[p + 1], 0.0, [(prompt[p + 1], 0.0)][:k]))


def build_sim_model(config: EngineConfig) -> tuple[SimRunner, ModelConfig, object, int]:
    """The simulated engine's runner, model config, tokenizer and KV block count; called
    by ``LLMEngine`` at start-up when ``config.simulate`` is set. The modelled model (a
    preset, or a checkpoint's config.json and tokenizer, never its weights) gives the
    vocabulary, context length and KV block count."""
    if config.kv_transport not in SIM_TRANSPORTS:
        raise ConfigError(f"a simulated engine moves KV with kv_transport tcp or none, "
                          f"not {config.kv_transport!r}")
    if config.kv_pool or config.tensor_parallel_size > 1 or config.device != "cpu":
        raise ConfigError("a simulated engine runs on cpu with tensor_parallel_size 1 and no kv_pool")
    config.simulate.validate()
    if config.model in PRESETS:
        modelled, tokenizer = preset_config(config.model), ByteTokenizer(PRESETS[config.model]["vocab_size"])
    else:
        from pdserve.runtime.gguf_file import parsed_once
        from pdserve.runtime.model_source import resolve

        path = Path(resolve(config.model))
        with parsed_once():
            modelled, tokenizer = ModelConfig.from_path(path), load_tokenizer(path)
        if tokenizer is None:
            raise ConfigError(f"{path} has no tokenizer.json, which a simulated engine "
                              f"generates its text with")
    bytes_per_block = modelled.kv_bytes_per_token(4 if config.dtype == "float32" else 2) * config.block_size
    num_blocks = config.num_kv_blocks or config.kv_cache_bytes // bytes_per_block
    if num_blocks < 1:
        raise ConfigError(f"kv_cache_bytes={config.kv_cache_bytes} is below one block "
                          f"({bytes_per_block} bytes)")
    pattern = [t for t in tokenizer.encode(SIM_TEXT) if t not in modelled.eos_token_ids]
    model_config = ModelConfig(
        architecture=modelled.architecture, vocab_size=modelled.vocab_size, hidden_size=1,
        intermediate_size=1, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
        head_dim=1, max_position_embeddings=modelled.max_position_embeddings,
        eos_token_ids=modelled.eos_token_ids, name=modelled.name)
    runner = SimRunner(config.simulate, num_blocks, config.block_size, num_blocks * bytes_per_block,
                       pattern)
    return runner, model_config, tokenizer, num_blocks
