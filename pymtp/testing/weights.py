"""Weights that make a random tiny model behave like a noisy bigram model.

Random weights give a target that the MTP head can never predict, so speculative
decoding would reject every draft. Instead:

* `output.weight` row pi(x) is the direction of `token_embd` row x, so a hidden state
  close to embed(x) makes pi(x) the argmax (`logit_scale` sets the winning logit);
* trunk blocks write small random updates onto the residual stream (`noise` scales
  their output projections), which mixes in context and sometimes changes the argmax;
* the MTP block's `eh_proj` passes the normed embedding of the token it is given
  through unchanged, so it drafts pi(x_{t+1}), which is the target's likely x_{t+2};
  `mtp_noise` scales its own random updates.

pi is one long cycle over the tokens that detokenize to printable ASCII or "\\n", so
greedy text stays readable; every other token maps into that cycle too.
"""

from __future__ import annotations

import zlib

import numpy as np

from pymtp.testing.layout import Hparams
from pymtp.testing.tokenizer import Vocab, byte_to_unicode

_READABLE = frozenset(range(0x20, 0x7F)) | {0x0A}


def _rng(seed: int, name: str) -> np.random.Generator:
    """One stream per tensor, so a tensor does not depend on which others exist."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def readable_tokens(vocab: Vocab) -> np.ndarray:
    """Ids of normal tokens whose bytes are all printable ASCII or newline."""
    u2b = {u: b for b, u in byte_to_unicode().items()}
    ids = [
        i for i in range(vocab.n_normal) if all(u2b[ch] in _READABLE for ch in vocab.tokens[i])
    ]
    return np.asarray(ids, dtype=np.int64)


def bigram_map(vocab: Vocab, seed: int) -> np.ndarray:
    """pi as an array: `succ[x]` is the token the weights favour after x.  # [n_vocab]"""
    rng = _rng(seed, "bigram")
    cycle = rng.permutation(readable_tokens(vocab))
    succ = rng.choice(cycle, size=vocab.n_vocab)  # tokens outside the cycle
    succ[cycle] = np.roll(cycle, -1)
    return succ.astype(np.int64)


def embedding(hp: Hparams, seed: int) -> np.ndarray:
    """token_embd: i.i.d. N(0, 1) rows.  # [n_vocab, n_embd]"""
    return _rng(seed, "token_embd.weight").standard_normal((hp.n_vocab, hp.n_embd))


def lm_head(hp: Hparams, seed: int, succ: np.ndarray, logit_scale: float) -> np.ndarray:
    """output.weight: row pi(x) += unit(embed(x)) * logit_scale / sqrt(n_embd).

    The final RMSNorm gives the hidden state norm sqrt(n_embd), so a hidden state equal
    to embed(x) scores pi(x) at `logit_scale` and other rows at about N(0, 1.2).
    Rows no token maps to stay zero and so never win.  # [n_vocab, n_embd]
    """
    emb = embedding(hp, seed)
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    head = np.zeros_like(emb)
    np.add.at(head, succ, unit * (logit_scale / np.sqrt(hp.n_embd)))
    return head


def init_tensor(
    name: str,
    ne: tuple[int, ...],
    role: str,
    *,
    hp: Hparams,
    seed: int,
    succ: np.ndarray,
    noise: float,
    logit_scale: float,
) -> np.ndarray:
    """The float32 numpy array for one tensor (numpy shape = reversed ggml shape)."""
    shape = tuple(reversed(ne))
    rng = _rng(seed, name)
    if role == "norm":
        # Stored after the converter's +1, so 1.0 is an identity RMSNorm scale.
        out = np.ones(shape)
    elif role == "embed":
        out = embedding(hp, seed)
    elif role == "lm_head":
        out = lm_head(hp, seed, succ, logit_scale)
    elif role == "in":
        out = rng.standard_normal(shape) / np.sqrt(ne[0])
    elif role == "out":
        out = noise * rng.standard_normal(shape) / np.sqrt(ne[0])
    elif role == "eh_proj":
        # [n_embd, 2*n_embd]: the embedding half is the identity, the hidden half noise.
        out = noise * rng.standard_normal(shape) / np.sqrt(ne[0])
        out[:, : hp.n_embd] += np.eye(hp.n_embd)
    elif role == "ssm_a":
        out = -np.exp(rng.uniform(0.0, np.log(16.0), shape))  # -exp(A_log), as converted
    elif role == "ssm_dt":
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape))
        out = dt + np.log(-np.expm1(-dt))  # inverse softplus, as HF initialises dt_bias
    elif role == "conv":
        out = rng.standard_normal(shape) / np.sqrt(hp.ssm_d_conv)
    else:
        raise ValueError(f"unknown init role {role!r} for tensor {name!r}")
    return np.ascontiguousarray(out, dtype=np.float32)
