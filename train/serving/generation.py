"""Text generation: the prompt in one compiled pass, each new token in one compiled step.

A :class:`Generator` holds a served model: its weights in ``--dtype``
(:mod:`train.serving.weights`), its decoder and cache in ``--kv-dtype``
(:mod:`train.serving.cache`), and two programs compiled ahead of time for the shapes of a
request: ``prefill`` (the prompt, ``(batch, prompt)`` tokens, to the first new token) and
``step`` (one token ``(batch, 1)`` at a position given as an array, to the next, its cache
donated): the same step serves every token, nothing compiles per token. Sampling
(:mod:`train.serving.sampling`) is inside both, in float32, keyed by ``(seed, position)``.
Tokens past the first go :data:`DECODE_CHUNK` at a time through a third program, that step
scanned on the device (the same tokens, bit for bit): one dispatch a chunk rather than one a
token, whose host time (about 1.3 ms a token on an H200, 2026-11-30, whatever the model's
depth) bounded a small model's decoding.

Past the model's context, the window slides: when the cache is full, its newest half is
taken as a new prompt (positions from 0 again) and decoding goes on from there; each token
still sees at least half the context. ``window=False`` refuses instead (one line).
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from train.serving.cache import Decoder, decoder_for
from train.serving.fused_decode import DECODE_KERNELS, fused_decoder, fused_refusal
from train.serving.kv_store import kv_dtype
from train.serving.sampling import Sampling, next_tokens
from train.serving.source import Source, load_source, sample_inputs
from train.serving.tokenizer import SampleError
from train.serving.weights import SERVING_DTYPES, ServedWeights, serve_weights, serving_dtype, tree_bytes

__all__ = ["Generation", "Generator", "generate", "DECODE_CHUNK"]

#: Tokens decoded by one dispatch of the chunk program (the step scanned on the device).
DECODE_CHUNK = 16


class Generation(NamedTuple):
    """What :func:`generate` made: ``texts`` (prompt and continuation, one per row),
    ``tokens`` ``(batch, n)`` new ids, the ``prompt`` ids, and how it went: seconds to the
    first token (the prefill and its sample, compiled beforehand), seconds for the rest,
    ``tokens_per_second`` (new tokens of every row after the first, per second of decoding),
    ``compile_seconds``, the bytes of the served weights and of the cache, what cache it had,
    how often the window slid."""

    texts: list[str]
    tokens: np.ndarray
    prompt: np.ndarray
    first_token_seconds: float
    decode_seconds: float
    tokens_per_second: float
    compile_seconds: float
    weight_bytes: int
    cache_bytes: int
    cache: str
    dtype: str
    slides: int

    def end_line(self) -> str:
        """The one line ``sample`` ends with."""
        slid = f"; the window slid {self.slides}x (newest half of the context kept)" if self.slides else ""
        return (f"{self.tokens_per_second:,.1f} tokens/s, first token in {1e3 * self.first_token_seconds:.1f} ms "
                f"(compiled in {self.compile_seconds:.1f} s); {self.dtype}; weights {_size(self.weight_bytes)}, "
                f"{self.cache} {_size(self.cache_bytes)}{slid}")


class Generator:
    """A model served for generation: ``source`` (a path or :class:`Source`) in ``dtype``, its
    cache in ``kv_dtype`` (None: the compute dtype), ``cache=False`` for decoding without one;
    ``decode_kernels``: ``xla`` (the model's modules) or ``fused`` (:mod:`train.serving.fused_decode`)."""

    def __init__(self, source: "Source | str", dtype: str = "bf16", kv_dtype_name: str | None = None,
                 cache: bool = True, decode_kernels: str = "xla"):
        self.source = source if isinstance(source, Source) else load_source(source)
        inputs = sample_inputs(self.source)
        key = serving_dtype(dtype)
        compute = SERVING_DTYPES[key][1]
        #: the model served and its float32 weights: a stored base's (adapters unmerged) for nf4
        self.model, self.float_params, codes = self.source.model, self.source.params, None
        if key == "nf4":
            base = _nf4_base(self.source)
            self.model, self.float_params, codes = base.model, base.params, base.codes
        self.served: ServedWeights = serve_weights(self.model, self.float_params, self.source.rules(compute), key,
                                                   inputs, self.source.state, codes)
        self.kv = kv_dtype(kv_dtype_name, self.served.compute)
        self.decoder: Decoder = decoder_for(self.model, self.served, self.kv, self.source.state, cache)
        if kv_dtype_name is not None and cache and not self.decoder.cached:
            raise SampleError(f"--kv-dtype {kv_dtype_name}: {type(self.source.model).__name__} keeps no KV cache "
                              f"(it samples the whole prefix each token, without one); leave --kv-dtype out")
        if decode_kernels not in DECODE_KERNELS:
            raise SampleError(f"--decode-kernels {decode_kernels}: give one of {', '.join(DECODE_KERNELS)}")
        if decode_kernels == "fused":
            refusal = fused_refusal(self.model, self.served.params) if self.decoder.cached else "no KV cache"
            if refusal:
                raise SampleError(f"--decode-kernels fused: {refusal}; leave it out (xla: the model's own modules)")
            self.decoder = fused_decoder(self.decoder, self.model)
        self.decode_kernels = decode_kernels
        self.params = jax.device_put(self.served.params)
        self._programs: dict[tuple, Any] = {}
        self.compile_seconds = 0.0

    def program(self, what: str, batch: int, length: int, count: int, sampling: Sampling) -> Any:
        """The compiled ``prefill`` (``count`` prompt tokens), ``step`` (``count`` 1) or ``chunk``
        (``count`` steps from one token) for a cache of ``length`` positions, compiled once per shape."""
        sampling = sampling._replace(seed=0)  # an argument of the program, not a part of it
        key = (what, batch, length, count, sampling)
        if key not in self._programs:
            start = time.perf_counter()
            cache = jax.eval_shape(lambda: self.decoder.init(batch, length))
            args = (self.params, cache, jax.ShapeDtypeStruct((batch, 1 if what == "chunk" else count), jnp.int32),
                    jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.uint32))
            pure = self.chunk(sampling, count) if what == "chunk" else self.run(sampling)
            jitted = jax.jit(pure, donate_argnums=(1,))
            self._programs[key] = jitted.lower(*args).compile()
            self.compile_seconds += time.perf_counter() - start
        return self._programs[key]

    def run(self, sampling: Sampling) -> Any:
        """The pure step ``(params, cache, tokens, index, seed) -> (next tokens, cache)``: the
        decoder on ``tokens`` at ``index``, then a token sampled from the last logits."""
        forward = self.decoder.forward

        def run(params, cache, tokens, index, seed):
            logits, cache = forward(params, cache, tokens, index)
            key = jax.random.fold_in(jax.random.key(seed), index + tokens.shape[1])
            return next_tokens(logits[:, -1], key, sampling), cache

        return run

    def chunk(self, sampling: Sampling, count: int) -> Any:
        """``(params, cache, token, index, seed) -> (count tokens, cache)``: :meth:`run`'s step
        ``count`` times on the device, each token fed to the next step (the tokens the steps
        one at a time give, with the same keys)."""
        step = self.run(sampling)

        def chunk(params, cache, token, index, seed):
            def one(carry, _):
                cache, token, index = carry
                token, cache = step(params, cache, token, index, seed)
                return (cache, token[:, None], index + 1), token

            (cache, _, _), tokens = jax.lax.scan(one, (cache, token, index), None, length=count)
            return tokens.T, cache

        return chunk

    def generate(self, prompt: str | Sequence[int], tokens: int = 100, sampling: Sampling = Sampling(),
                 batch: int = 1, window: bool = True) -> Generation:
        """``tokens`` new tokens after ``prompt`` (text, or token ids) for ``batch`` rows."""
        ids = self.source.tokenizer.encode(prompt) if isinstance(prompt, str) else np.asarray(prompt, np.int32)
        sampling = sampling.checked(self.source.tokenizer.size)
        length = self.cache_length(len(ids), tokens, window)
        if batch < 1 or tokens < 1:
            raise SampleError(f"--{'batch' if batch < 1 else 'tokens'} {min(batch, tokens)}: give at least 1")
        seed = np.uint32(sampling.seed % 2 ** 32)
        prefill = self.program("prefill", batch, length, len(ids), sampling)
        step = self.program("step", batch, length, 1, sampling)
        chunk = self.program("chunk", batch, length, DECODE_CHUNK, sampling) if tokens > DECODE_CHUNK else None
        if len(ids) + tokens > length:  # the window will slide: its prompt's program too, before the clock
            self.program("prefill", batch, length, length // 2, sampling)
        rows = np.broadcast_to(ids, (batch, len(ids)))
        start = time.perf_counter()
        token, cache = prefill(self.params, self.decoder.init(batch, length), jnp.asarray(rows), np.int32(0), seed)
        out, position, slides, left = [token[:, None]], len(ids), 0, tokens - 1
        token.block_until_ready()
        first = time.perf_counter()
        cache_bytes = tree_bytes(cache)
        while left:
            if position == length:  # the cache is full: its newest half is the prompt from here
                kept = length // 2
                recent = np.concatenate([rows, *[np.asarray(t) for t in out]], 1)[:, -kept:]
                again = self.program("prefill", batch, length, kept, sampling)
                token, cache = again(self.params, self.decoder.init(batch, length), jnp.asarray(recent),
                                     np.int32(0), seed)
                position, slides, block = kept, slides + 1, token[:, None]
            elif chunk is not None and left >= DECODE_CHUNK and position + DECODE_CHUNK <= length:
                block, cache = chunk(self.params, cache, token[:, None], np.int32(position), seed)
                token, position = block[:, -1], position + DECODE_CHUNK
            else:
                token, cache = step(self.params, cache, token[:, None], np.int32(position), seed)
                position, block = position + 1, token[:, None]
            out.append(block)
            left -= block.shape[1]
        new = np.concatenate([np.asarray(t) for t in out], 1)
        end = time.perf_counter()
        texts = [self.source.tokenizer.decode(np.concatenate([ids, row])) for row in new]
        rate = batch * (tokens - 1) / (end - first) if tokens > 1 else 0.0
        return Generation(texts, new, ids, first - start, end - first, rate, self.compile_seconds,
                          tree_bytes(self.params), cache_bytes, self.decoder.describe() + self._kernels(batch),
                          self.served.dtype, slides)

    def _kernels(self, batch: int) -> str:
        """What the end line says of ``--decode-kernels fused``: taken, or why not at ``batch``."""
        if self.decode_kernels != "fused":
            return ""
        refusal = fused_refusal(self.model, self.served.params, batch)
        return f", each token not fused ({refusal})" if refusal else ", each token in fused kernels"

    def logits(self, tokens: Any) -> np.ndarray:
        """The float32 logits ``(batch, length, vocab)`` of ``tokens`` ``(batch, length)`` read
        as one prompt through the served model and its cache (teacher forcing: perplexity, and
        the agreement of greedy tokens with another dtype)."""
        tokens = jnp.asarray(tokens, jnp.int32)
        batch, length = tokens.shape
        key = ("logits", batch, length)
        if key not in self._programs:
            self._programs[key] = jax.jit(lambda p, t: self.decoder.forward(p, self.decoder.init(batch, length), t,
                                                                            jnp.int32(0))[0])
        return np.asarray(self._programs[key](self.params, tokens))

    def cache_length(self, prompt: int, tokens: int, window: bool = True) -> int:
        """The cache's positions for ``prompt`` and ``tokens`` new ones: all of them, or the context."""
        context, where = self.source.context, self.source.context_from
        if prompt < 1:
            raise SampleError("the prompt is empty: give at least one character (--prompt TEXT)")
        if context is None or prompt + tokens <= context:
            return prompt + tokens
        if prompt >= context:
            raise SampleError(f"the prompt has {prompt} tokens: the model's context is {context} positions ({where}); "
                              f"give a shorter prompt")
        if not window:
            raise SampleError(f"--tokens {tokens}: the prompt ({prompt} tokens) and {tokens} new tokens pass the "
                              f"model's context of {context} positions ({where}) and the window may not slide; give "
                              f"--tokens {context - prompt} or fewer")
        return context


def generate(source: "Source | str", prompt: str | Sequence[int], *, tokens: int = 100, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0, batch: int = 1,
             dtype: str = "bf16", kv_dtype: str | None = None, cache: bool = True, window: bool = True,
             decode_kernels: str = "xla") -> Generation:
    """Generates ``tokens`` new tokens after ``prompt`` from the model ``source`` holds (a run, an
    export or a Hugging Face directory; or a :class:`Source`), ``batch`` rows, weights in
    ``dtype`` (``bf16``, ``f16``, ``f32``, ``int8``; ``nf4``: a QLoRA run as stored), the KV
    cache in ``kv_dtype`` (``bf16``, ``f16``, ``int8``, ``fp8``; None: the compute dtype),
    sampled in float32 at ``temperature`` (0: greedy) from the ``top_k`` / ``top_p`` tokens,
    keyed by ``seed``. The prompt goes in one compiled pass, each token in one compiled step
    (``decode_kernels="fused"``: a Llama's or GPT-2's in five kernels a layer, :mod:`train.serving.fused_decode`).
    Raises :class:`SampleError` (one line)."""
    generator = Generator(source, dtype, kv_dtype, cache, decode_kernels)
    return generator.generate(prompt, tokens, Sampling(temperature, top_k, top_p, seed), batch, window)


def _nf4_base(source: Source) -> Any:
    """``source``'s weights as stored in nf4 codes, or :class:`SampleError` naming what it holds."""
    base = source.base
    if base is not None and base.code == "nf4":
        return base
    holds = (f"its base in {base.code} codes" if base is not None else
             "merged float weights" if source.kind == "export" else "no weights in codes")
    raise SampleError(f"--dtype nf4 serves a run fine-tuned on an nf4 base (finetune.base: nf4) as it stored it; "
                      f"{source.path} holds {holds}: give bf16, f16, f32 or int8 (weight-only, a scale per output "
                      f"channel)")


def _size(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} bytes"
