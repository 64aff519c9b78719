"""A reference Llama forward in numpy (float64 by default) over a GGUF's weights.

The weights are read and dequantized with the PyPI package ``gguf``
(``gguf.GGUFReader``, ``gguf.quants.dequantize``, which dequantizes to float32:
``d * q + m`` with the file's f16 scales, exact up to that one f32 rounding).
From there every operation runs in the requested dtype, one call over all
positions of a sequence with a causal mask:

embedding → per layer [RMSNorm → Q, K, V → RoPE → grouped-query attention →
output projection → residual → RMSNorm → SiLU(gate) · up → down → residual]
→ final RMSNorm → output head (``output.weight``, else tied to
``token_embd.weight``).

RoPE is the GGUF ``llama`` convention that our engine and llama.cpp (rope
mode 0) use: the converter permutes Q and K rows so that *adjacent* pairs
``(x[2i], x[2i+1])`` rotate by ``pos · base^(-2i/rope_dims)``; with a
``rope_freqs.weight`` tensor (Llama-3.1's ``llama3`` scaling as the converter
writes it) the angle of pair ``i`` is divided by ``rope_freqs[i]``, as ggml
does. Anything else that changes the forward (another architecture, a
``rope.scaling.type`` other than none/llama3) raises ``NotImplementedError``
naming it, never a silent approximation.

Used by ``tests/python/test_numerics.py``; importable on its own::

    m = ref_forward.load("model.gguf")
    logits = m.forward([1, 2, 3])          # [3, vocab] float64
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize


def _field(reader: GGUFReader, key: str):
    """A metadata value (scalar or string), or None when the key is absent."""
    f = reader.fields.get(key)
    if f is None:
        return None
    part = f.parts[f.data[0]]
    if f.types[0] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    if f.types[0] == GGUFValueType.ARRAY:
        raise ValueError(f"{key} is an array, not a scalar")
    return part.tolist()[0]


@dataclasses.dataclass(frozen=True)
class Config:
    """The shape of the model, from the ``{arch}.*`` metadata."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_dims: int
    rope_base: float
    eps: float
    vocab: int


class RefModel:
    """Dequantized weights and the forward. See the module docstring."""

    def __init__(self, path: str | Path):
        reader = GGUFReader(str(path))
        arch = _field(reader, "general.architecture")
        if arch != "llama":
            raise NotImplementedError(f"general.architecture = {arch!r} (only 'llama')")
        scaling = _field(reader, f"{arch}.rope.scaling.type")
        if scaling not in (None, "none", "llama3"):
            raise NotImplementedError(f"{arch}.rope.scaling.type = {scaling!r}")
        self._f32: dict[str, np.ndarray] = {}
        for t in reader.tensors:
            data = dequantize(t.data, t.tensor_type)
            shape = tuple(int(x) for x in reversed(t.shape))
            self._f32[t.name] = np.asarray(data, dtype=np.float32).reshape(shape)
        key = lambda k: _field(reader, f"{arch}.{k}")  # noqa: E731
        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        kv_heads = int(key("attention.head_count_kv") or heads)
        head_dim = int(key("attention.key_length") or hidden // heads)
        self.cfg = Config(
            layers=int(key("block_count")),
            hidden=hidden,
            ffn=int(key("feed_forward_length")),
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            rope_dims=min(int(key("rope.dimension_count") or head_dim), head_dim) & ~1,
            rope_base=float(key("rope.freq_base") or 10000.0),
            eps=float(key("attention.layer_norm_rms_epsilon") or 1e-5),
            vocab=self._f32["token_embd.weight"].shape[0],
        )
        ff = self._f32.get("rope_freqs.weight")
        if ff is not None and ff.shape != (self.cfg.rope_dims // 2,):
            raise ValueError(f"rope_freqs.weight has shape {ff.shape}, want ({self.cfg.rope_dims // 2},)")
        self.rope_freqs = ff
        self._cast: dict[tuple[str, str], np.ndarray] = {}

    def weight(self, name: str, dtype=np.float64) -> np.ndarray:
        """Tensor ``name`` as ``dtype`` (cached); KeyError when absent."""
        k = (name, np.dtype(dtype).str)
        if k not in self._cast:
            self._cast[k] = self._f32[name].astype(dtype)
        return self._cast[k]

    def has(self, name: str) -> bool:
        """Whether the file has tensor ``name``."""
        return name in self._f32

    def rope_angles(self, positions: np.ndarray, dtype=np.float64) -> np.ndarray:
        """``[positions, rope_dims / 2]`` angles (float64 math, then ``dtype``)."""
        c = self.cfg
        i = np.arange(c.rope_dims // 2, dtype=np.float64)
        inv = c.rope_base ** (-2.0 * i / c.rope_dims)
        if self.rope_freqs is not None:
            inv = inv / self.rope_freqs.astype(np.float64)
        return (positions.astype(np.float64)[:, None] * inv[None, :]).astype(dtype)

    def forward(self, ids, dtype=np.float64) -> np.ndarray:
        """Logits ``[len(ids), vocab]`` of every position (causal), in ``dtype``."""
        c = self.cfg
        ids = np.asarray(ids, dtype=np.int64)
        n = len(ids)
        w = lambda name: self.weight(name, dtype)  # noqa: E731
        one = dtype(1.0)

        def rms(x, g):
            ms = np.mean(x * x, axis=-1, keepdims=True)
            return x / np.sqrt(ms + dtype(c.eps)) * g

        theta = self.rope_angles(np.arange(n), dtype)
        cos, sin = np.cos(theta), np.sin(theta)

        def rope(x):  # x: [n, heads, head_dim]
            r = c.rope_dims
            a, b = x[:, :, 0:r:2], x[:, :, 1:r:2]
            out = x.copy()
            out[:, :, 0:r:2] = a * cos[:, None, :] - b * sin[:, None, :]
            out[:, :, 1:r:2] = a * sin[:, None, :] + b * cos[:, None, :]
            return out

        mask = np.triu(np.full((n, n), -np.inf, dtype=dtype), k=1)
        group = c.heads // c.kv_heads
        scale = one / np.sqrt(dtype(c.head_dim))
        x = w("token_embd.weight")[ids]
        for li in range(c.layers):
            p = lambda name: w(f"blk.{li}.{name}.weight")  # noqa: E731,B023
            h = rms(x, p("attn_norm"))
            q = rope((h @ p("attn_q").T).reshape(n, c.heads, c.head_dim))
            k = rope((h @ p("attn_k").T).reshape(n, c.kv_heads, c.head_dim))
            v = (h @ p("attn_v").T).reshape(n, c.kv_heads, c.head_dim)
            q = q.transpose(1, 0, 2)  # [heads, n, hd]
            k = np.repeat(k.transpose(1, 0, 2), group, axis=0)
            v = np.repeat(v.transpose(1, 0, 2), group, axis=0)
            s = q @ k.transpose(0, 2, 1) * scale + mask
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            s = s / s.sum(axis=-1, keepdims=True)
            a = (s @ v).transpose(1, 0, 2).reshape(n, c.heads * c.head_dim)
            x = x + a @ p("attn_output").T
            h = rms(x, p("ffn_norm"))
            g = h @ p("ffn_gate").T
            u = h @ p("ffn_up").T
            x = x + (g / (one + np.exp(-g)) * u) @ p("ffn_down").T
        h = rms(x, w("output_norm.weight"))
        head = w("output.weight") if self.has("output.weight") else w("token_embd.weight")
        return h @ head.T


def load(path: str | Path) -> RefModel:
    """Reads and dequantizes a GGUF Llama (see the module docstring)."""
    return RefModel(path)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def kl(ref_logits: np.ndarray, other_logits: np.ndarray) -> np.ndarray:
    """Per-row KL(ref || other) in nats, float64."""
    lp, lq = log_softmax(ref_logits), log_softmax(other_logits)
    return np.sum(np.exp(lp) * (lp - lq), axis=-1)
