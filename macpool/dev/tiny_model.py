"""Random-weight llama-architecture GGUF models for tests, written to the cache on demand.

``ensure("tiny")`` writes (once) a deterministic 2-layer model like the one the recordings in
``/work/shared/reference/llama-server/`` were made with: SPM vocabulary of ``<unk>``, ``<s>``, ``</s>``
and the 256 byte tokens, n_embd 64, 4 heads, 2 KV heads, F32. ``ensure("small")`` is a larger F16
model whose decode takes a realistic time on one CPU thread (about 5 ms a token), so a long request
keeps a slot busy for seconds. ``ensure("fim")`` is ``tiny`` with Qwen's fill-in-the-middle control tokens
(``<|fim_prefix|>``, ``<|fim_suffix|>``, ``<|fim_middle|>``) after the byte tokens, so llama-server serves
``/infill`` with it. ``ensure("calibrate")`` is a Q4_0 model (~87 MB) whose decode throughput on
one thread grows with the batch up to a few sequences, then stays flat: a real saturation point for
``macpool agent calibrate`` to find. No model binary is committed; the files are generated from a seed.

``kv_bytes_per_token(path)`` derives the KV-cache bytes per token from a GGUF's metadata (independent
of the agent's own reader in ``macpool/gguf_info.py``): layers x KV heads x head dim x 2 (K and V)
x bytes per cache element (2 for llama-server's default f16 cache).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from macpool.dev.llama_build import cache_root

# Bump when the generator's output changes, so stale cached files are not reused.
FORMAT_VERSION = 2

CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\n' -}}\n"
    "{%- endif -%}"
)

# gguf TokenType values (gguf.TokenType), spelled out so the module has no import-time dependency on it.
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_BYTE = 1, 2, 3, 6
F16_BYTES = 2


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a generated model."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int = 4096
    f16: bool = False
    quant: str | None = None  # a gguf quantization type ("Q4_0") for the 2-D weights but token_embd
    fim: bool = False  # fill-in-the-middle control tokens after the byte tokens (llama-server's /infill)
    seed: int = 1234
    rms_eps: float = 1e-5
    rope_freq_base: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def kv_bytes_per_token(self, cache_bytes: int = F16_BYTES) -> int:
        return self.n_layer * self.n_head_kv * self.head_dim * 2 * cache_bytes


VARIANTS: dict[str, ModelSpec] = {
    # 107,200 parameters, ~430 KB: the recordings' model. Trained "for" 64K tokens, so that a coding agent's
    # turn (20-30K tokens of system prompt and tools, a token a byte here) fits in a slot of its own.
    "tiny": ModelSpec("tiny", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_ctx_train=65536),
    # ~19 M parameters in F16 (~38 MB): a generation takes seconds on one CPU thread (`-t 1`), so a test
    # can act while it runs, and the model still loads at once.
    "small": ModelSpec("small", n_layer=6, n_embd=512, n_head=8, n_head_kv=4, n_ff=1536, f16=True),
    # ~150 M parameters in Q4_0 (~87 MB, written in a few seconds): on one CPU thread decode throughput
    # rises up to 4 sequences per batch, then stays flat (docs/agent.md, "macpool agent calibrate").
    "calibrate": ModelSpec(
        "calibrate", n_layer=4, n_embd=2048, n_head=32, n_head_kv=16, n_ff=4096, quant="Q4_0"
    ),
    # tiny's shape with FIM tokens: llama-server answers /infill with it (501 without them)
    "fim": ModelSpec("fim", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, fim=True),
}
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def vocabulary(fim: bool = False) -> tuple[list[str], list[float], list[int]]:
    """The SPM vocabulary: ``<unk>``, ``<s>``, ``</s>`` then ``<0x00>``..``<0xFF>`` (then, with ``fim``,
    the FIM control tokens)."""
    extra = list(FIM_TOKENS) if fim else []
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + extra
    scores = [0.0] * len(tokens)
    types = [_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_CONTROL] + [_TOKEN_BYTE] * 256
    types += [_TOKEN_CONTROL] * len(extra)
    return tokens, scores, types


def model_path(variant: str = "tiny") -> Path:
    """Where ``ensure(variant)`` writes the model (the file name is the model's name on llama-server).

    The directory names the generator version and a digest of the variant's shape, so changing either
    never reuses a stale cached file.
    """
    spec = VARIANTS[variant]
    digest = hashlib.sha256(repr(spec).encode()).hexdigest()[:8]
    return cache_root() / "models" / f"v{FORMAT_VERSION}-{digest}" / f"{variant}.gguf"


# The generated text is printable ASCII (bytes 0x20-0x7E) and never ends early with </s>: residual dimension 0
# carries a large constant (the embedding sets it, no layer writes to it, the layer norms ignore it), so after
# the final norm it is a positive constant that output.weight[:, 0] turns into a +/- logit offset per token.
# Random weights otherwise. This keeps llama-server's streams regular (one content chunk per token, the role
# chunk first): with arbitrary bytes it withholds incomplete UTF-8 sequences, and skips the role chunk when
# the first token is one.
ALLOWED_BYTES = range(0x20, 0x7F)
_CONSTANT_DIM_VALUE = 8.0  # x sqrt(n_embd)
_LOGIT_OFFSET = 4.0


def _allowed_mask(n_vocab: int) -> np.ndarray[Any, Any]:
    mask = np.zeros(n_vocab, dtype=bool)
    mask[[3 + b for b in ALLOWED_BYTES]] = True
    return mask


def _tensors(spec: ModelSpec, n_vocab: int) -> list[tuple[str, np.ndarray[Any, Any]]]:
    """All weights, in numpy (row-major) shape; deterministic from ``spec.seed``."""
    rng = np.random.RandomState(spec.seed)
    dtype = np.float16 if spec.f16 else np.float32
    q_dim, kv_dim = spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim

    def weight(rows: int, cols: int, scale: float = 1.0) -> np.ndarray[Any, Any]:
        # ~N(0, 1/cols) keeps activations bounded through the layers.
        values: np.ndarray[Any, Any] = rng.standard_normal((rows, cols)) * (scale / np.sqrt(cols))
        return values

    def layer_norm() -> np.ndarray[Any, Any]:
        norm = np.ones(spec.n_embd, dtype=np.float32)  # norms stay F32, as converters write them
        norm[0] = 0.0  # the layers do not see the constant dimension...
        return norm

    def writes_residual(rows: int, cols: int) -> np.ndarray[Any, Any]:
        values = weight(rows, cols)
        values[0, :] = 0.0  # ...nor write to it
        return values.astype(dtype)

    embd = weight(n_vocab, spec.n_embd, scale=np.sqrt(spec.n_embd))  # ~N(0, 1) per element
    embd[:, 0] = _CONSTANT_DIM_VALUE * np.sqrt(spec.n_embd)
    out: list[tuple[str, np.ndarray[Any, Any]]] = [("token_embd.weight", embd.astype(dtype))]
    for i in range(spec.n_layer):
        out += [
            (f"blk.{i}.attn_norm.weight", layer_norm()),
            (f"blk.{i}.attn_q.weight", weight(q_dim, spec.n_embd).astype(dtype)),
            (f"blk.{i}.attn_k.weight", weight(kv_dim, spec.n_embd).astype(dtype)),
            (f"blk.{i}.attn_v.weight", weight(kv_dim, spec.n_embd).astype(dtype)),
            (f"blk.{i}.attn_output.weight", writes_residual(spec.n_embd, q_dim)),
            (f"blk.{i}.ffn_norm.weight", layer_norm()),
            (f"blk.{i}.ffn_gate.weight", weight(spec.n_ff, spec.n_embd).astype(dtype)),
            (f"blk.{i}.ffn_up.weight", weight(spec.n_ff, spec.n_embd).astype(dtype)),
            (f"blk.{i}.ffn_down.weight", writes_residual(spec.n_embd, spec.n_ff)),
        ]
    output = weight(n_vocab, spec.n_embd, scale=2.0 * np.sqrt(spec.n_embd / 64))
    output[:, 0] = np.where(_allowed_mask(n_vocab), _LOGIT_OFFSET, -_LOGIT_OFFSET)
    out += [
        ("output_norm.weight", np.ones(spec.n_embd, dtype=np.float32)),
        ("output.weight", output.astype(dtype)),
    ]
    return out


def _file_type(spec: ModelSpec) -> int:
    """``general.file_type``: LLAMA_FTYPE_ALL_F32 (0), MOSTLY_F16 (1) or MOSTLY_Q4_0 (2)."""
    if spec.quant:
        return {"Q4_0": 2}[spec.quant]
    return 1 if spec.f16 else 0


def write(spec: ModelSpec, path: Path) -> None:
    """Write ``spec`` as a GGUF to ``path`` (not atomically: see ``ensure``)."""
    import gguf

    tokens, scores, types = vocabulary(spec.fim)
    writer = gguf.GGUFWriter(str(path), "llama")
    try:
        writer.add_name(f"macpool-{spec.name}")
        writer.add_context_length(spec.n_ctx_train)
        writer.add_embedding_length(spec.n_embd)
        writer.add_block_count(spec.n_layer)
        writer.add_feed_forward_length(spec.n_ff)
        writer.add_head_count(spec.n_head)
        writer.add_head_count_kv(spec.n_head_kv)
        writer.add_layer_norm_rms_eps(spec.rms_eps)
        writer.add_rope_dimension_count(spec.head_dim)
        writer.add_rope_freq_base(spec.rope_freq_base)
        writer.add_vocab_size(len(tokens))
        writer.add_file_type(_file_type(spec))
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        if spec.fim:
            ids = gguf.Keys.Tokenizer
            for key, token in zip((ids.FIM_PRE_ID, ids.FIM_SUF_ID, ids.FIM_MID_ID), FIM_TOKENS, strict=True):
                writer.add_uint32(key, tokens.index(token))
        writer.add_chat_template(CHAT_TEMPLATE)
        for name, tensor in _tensors(spec, len(tokens)):
            if spec.quant and tensor.ndim == 2 and name != "token_embd.weight":
                qtype = gguf.GGMLQuantizationType[spec.quant]
                writer.add_tensor(name, gguf.quants.quantize(tensor, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(name, tensor)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def ensure(variant: str = "tiny") -> Path:
    """Return the cached model for ``variant``, generating it first if absent (safe in parallel)."""
    try:
        spec = VARIANTS[variant]
    except KeyError:
        raise ValueError(f"unknown model variant {variant!r} (known: {', '.join(VARIANTS)})") from None
    path = model_path(variant)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{variant}-", suffix=".gguf.tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(spec, tmp)
        os.replace(tmp, path)  # atomic: concurrent writers produce identical bytes, the last rename wins
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_metadata(path: Path) -> dict[str, Any]:
    """The scalar metadata of a GGUF file (arrays are left out), read with ``gguf.GGUFReader``."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not field.types or field.types[0] == gguf.GGUFValueType.ARRAY:
            continue
        out[key] = field.contents()
    return out


def kv_bytes_per_token(path: Path, cache_bytes: int = F16_BYTES) -> int:
    """KV-cache bytes per token of context, from the GGUF's metadata (f16 cache by default)."""
    meta = read_metadata(path)
    arch = meta["general.architecture"]
    n_layer = int(meta[f"{arch}.block_count"])
    n_embd = int(meta[f"{arch}.embedding_length"])
    n_head = int(meta[f"{arch}.attention.head_count"])
    n_head_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_head))
    key_len = int(meta.get(f"{arch}.attention.key_length", n_embd // n_head))
    value_len = int(meta.get(f"{arch}.attention.value_length", n_embd // n_head))
    return n_layer * n_head_kv * (key_len + value_len) * cache_bytes


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="macpool dev tiny-model", description=__doc__)
    parser.add_argument("--variant", default="tiny", choices=sorted(VARIANTS))
    args = parser.parse_args(argv)
    print(ensure(args.variant))
    return 0
